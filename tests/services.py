"""What a test does when a server it needs (PostgreSQL, Redis, a kube-apiserver) is not there.

Outside CI it skips and says why, so a developer without the servers still runs the rest. Under CI
(`CI` set, as `.ci/run` runs) it fails: `.ci/run` starts every server, so one missing there is a
broken set-up, and a suite that went green by skipping would hide it.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

START_HINT = "start them with `bash scripts/test_services.sh` (root)"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def missing_service(reason: str, hint: str = START_HINT) -> NoReturn:
    """Skip (developer machine) or fail (CI) the calling test, naming what is missing."""
    message = f"{reason}; {hint}"
    if in_ci():
        pytest.fail(f"CI: {message}", pytrace=False)
    pytest.skip(message)


def installed(*names: str, package: str) -> str:
    """The path of the first of `names` on PATH; else skip or fail (as `missing_service`) naming the
    Debian `package` that provides it (`scripts/test_services.sh` installs it)."""
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    missing_service(f"{names[0]} is not installed (Debian package {package})")
