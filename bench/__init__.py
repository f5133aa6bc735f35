"""The controller benchmark: baselines, scenarios and the harness behind ``deo bench``."""
