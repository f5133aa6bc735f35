"""The simulator: an Atropos-style RL loop in simulated time, driving the real core."""
