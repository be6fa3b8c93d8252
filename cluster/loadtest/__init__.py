"""Load tests: `pdcluster bench`, its datasets, load generator and plots."""
