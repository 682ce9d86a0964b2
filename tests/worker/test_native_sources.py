"""The C kernels' sources (worker/ops/native/csrc): one translation unit, kernels.c, includes a file per
op and the headers they share. These check what that split must keep true: every file is part of the
build's cache key and of the installed package, each part names the headers it needs, and every ISA's
build compiles here, whether or not this CPU can run it."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from inferplane.worker.ops.native import build

HAS_TOOLCHAIN = platform.machine() == "x86_64" and shutil.which("cc") is not None
needs_toolchain = pytest.mark.skipif(not HAS_TOOLCHAIN, reason="no x86-64 C toolchain")
CSRC = build.SOURCE.parent
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _local_includes(path: Path) -> list[str]:
    return re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.MULTILINE)


def test_the_translation_unit_includes_every_part_and_only_files_beside_it():
    """A part kernels.c does not include would never be compiled; an include from elsewhere would be
    missing from the cache key (source_digest hashes the files beside kernels.c)."""
    names = {path.name for path in build.source_files()}
    assert build.SOURCE.name in names
    parts = {name for name in names if name.endswith(".c")} - {build.SOURCE.name}
    assert parts and parts <= set(_local_includes(build.SOURCE))
    for path in build.source_files():
        assert set(_local_includes(path)) <= names, path.name


def test_an_edit_to_any_c_file_changes_the_build_key(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    monkeypatch.setattr(build, "SOURCE", copy / build.SOURCE.name)
    keys = {build.source_digest()}
    for path in sorted(copy.iterdir()):
        path.write_text(path.read_text() + "\n")
        keys.add(build.source_digest())
    assert len(keys) == len(list(copy.iterdir())) + 1
    (copy / "new_part.c").write_text("\n")  # a new file counts before anything includes it
    assert build.source_digest() not in keys


def test_the_package_data_carries_every_c_file():
    """The image installs a wheel of the project (deploy/image/build.py): a header left out of it
    would fail every build there."""
    patterns = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]["*"]
    assert {f"*{path.suffix}" for path in build.source_files()} <= set(patterns)


@needs_toolchain
@pytest.mark.parametrize("isa", ["avx512-vnni", "avx2-vnni-emulated"])
def test_each_part_compiles_alone_with_the_headers_it_names(isa):
    """So a reader (or an editor) can open one op's file: it names what it uses. An undeclared function
    or an undefined macro in an #if (which would quietly take the other branch) is an error. The two
    ISAs cover both int8 branches (AVX-512, and AVX2 with the AVX-VNNI code)."""
    flags = build.ISA_BUILDS[isa][0] if isa in build.ISA_BUILDS else build.EMULATED_BUILDS[isa][0]
    cmd = [build._compiler(), "-fsyntax-only", "-fopenmp", "-Werror=implicit-function-declaration", "-Werror=undef",
           *flags, *map(str, build.source_files())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@needs_toolchain
def test_every_isa_build_compiles_even_where_this_cpu_cannot_run_it(tmp_path):
    """The tests run only the builds this CPU has (test_native.py); an AVX2 machine would otherwise
    never compile the AVX-512 code."""
    unrunnable = [isa for isa in build.ISA_BUILDS if isa not in build.supported_isas()]
    for isa in unrunnable:
        try:
            build._build(build._compiler(), isa, tmp_path / f"{isa}.so")
        except RuntimeError as exc:
            if isa == "avx2-vnni" and "avxvnni" in str(exc):  # GCC before 11 has no -mavxvnni
                continue
            raise
        assert (tmp_path / f"{isa}.so").stat().st_size > 0
