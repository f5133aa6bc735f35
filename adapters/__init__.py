"""deo's adapters: the I/O around the pure core, one subpackage per role."""
