"""`python -m cluster.cli`: the `pdcluster` command."""
from cluster.cli import main

main()
