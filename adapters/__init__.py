"""deo's adapters: the I/O around the pure core (event log, replay, CLI, and later the runtime)."""
