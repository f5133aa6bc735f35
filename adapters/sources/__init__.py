"""Event sources: pressure (JSON, Atropos), heartbeat files, GPU health (NVML)."""
