"""`python -m crabd.cli`: the `crabd` console script."""

from . import main

main()
