"""The HTTP API of a running deo and its client (``deo status``, ``deo stop``)."""
