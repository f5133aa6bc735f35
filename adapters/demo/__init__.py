"""``deo demo``: a real Atropos loop here (API server, a stand-in trainer, env workers)."""
