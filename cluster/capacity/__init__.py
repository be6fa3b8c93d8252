"""Capacity: `pdcluster profile`, `simulate` and `plan`, and the simulator they run."""
