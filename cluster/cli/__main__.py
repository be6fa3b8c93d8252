"""`python -m cluster.cli`: the `pdcluster` command, with its exit status."""
import sys

from cluster.cli import main

sys.exit(main())
