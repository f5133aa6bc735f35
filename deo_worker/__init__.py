"""Worker-side helpers: drain on deo's signal and send heartbeats, for any worker process."""
