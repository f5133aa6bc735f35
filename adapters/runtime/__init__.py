"""The local runtime behind ``deo run``: runner loop, processes, configuration, live view."""
