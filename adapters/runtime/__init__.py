"""What ``deo run`` runs on: the runner loop, worker processes, configuration, live view."""
