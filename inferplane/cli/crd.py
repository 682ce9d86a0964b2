"""`inferplane crd`: the InferenceDeployment CRD generated from the spec models (see api/crd.py).

Prints it, or with --write updates the committed copies (`make crds` writes deploy/crds and the
chart's crds/), so that `kubectl apply -f <(inferplane crd)` installs exactly what this version reads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--write", nargs="+", type=Path, metavar="DIR",
                        help="write the CRD file into these directories instead of printing it")


def run(args: argparse.Namespace) -> int:
    from inferplane.api import crd

    if not args.write:
        sys.stdout.write(crd.crd_yaml())
        return 0
    for path in crd.write(args.write):
        print(f"wrote {path}")
    return 0
