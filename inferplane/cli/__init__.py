"""The `inferplane` console script (main.py) and the subcommands that belong to no one layer."""

from inferplane.cli.main import main

__all__ = ["main"]
