"""Building and loading the C kernels: one build of csrc/ per instruction set, for this CPU.

Why C and why at run time: at decode sizes (a few to a few dozen rows) PyTorch's eager CPU ops spend
more time on per-call work than on arithmetic. `torch._int_mm` reorders the int8 weight on every
call and quantizing the input rows took five eager ops (on CPUs without VNNI it ran 10x slower
than float32 altogether); decode attention first copied each sequence's KV blocks into one tensor
and then ran SDPA. The C versions read a weight laid out once at load time and KV blocks where they
lie in the cache. Measured on this project's 2-core AVX-512 VNNI machine, 16 rows: 2-3x less time
per int8 linear than `_int_mm` for SmolLM2's shapes, and a third of the time for decode attention
at ~140 tokens of context.

One source, one build per instruction set (ISA_BUILDS, best first): AVX-512 VNNI, AVX2 with
AVX-VNNI, plain AVX2 + FMA. The source is csrc/: kernels.c, the one file compiled, includes each
op's part (int8_linear.c, attention.c, ...) and the headers they share (common.h: the ISA macros
and the vector layer), so the compiler sees one translation unit and inlines every static helper
where it is used. `kernels()` loads the best build this CPU can run, or the one
`INFERPLANE_NATIVE_ISA` names (how the tests run the AVX2 code on an AVX-512 machine);
`kernels_for(isa)` loads a given one. A C compiler is the only requirement (no PyTorch headers, so
a build takes about a second); libraries are cached under `INFERPLANE_NATIVE_DIR` (default
`~/.cache/inferplane/native`), keyed by the ISA, every C file of the source (source_digest), the
compiler and the CPU's flags.
Without a compiler, on another architecture, on an x86 CPU older than AVX2, or with
`INFERPLANE_NATIVE=0`, `kernels()` returns None and callers keep their PyTorch paths: the kernels
change speed, never results beyond float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from inferplane.worker.ops.native.bindings import NativeKernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "kernels.c"  # the translation unit; it includes the files beside it
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-Wall")
_X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# ISA name -> (compiler flags, the /proc/cpuinfo flags it needs); best first.
ISA_BUILDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512-vnni": (("-march=x86-64-v4", "-mavx512vnni"), _X86_64_V4 | {"avx512_vnni"}),
    "avx2-vnni": (("-march=x86-64-v3", "-mavxvnni"), _X86_64_V3 | {"avx_vnni"}),
    "avx2": (("-march=x86-64-v3",), _X86_64_V3),
}
# Test builds: an ISA_BUILDS entry's code on a CPU that lacks its one extra instruction, which the
# build does in exact operations of the CPU it runs on (csrc/common.h IP_EMULATE_AVX_VNNI). Why: no
# machine here has AVX-VNNI (Intel's hybrid client CPUs do), so its build's tiles never ran.
# Never chosen by kernels(); the tests load them with kernels_for. Name -> (compiler flags, the
# cpuinfo flags it needs, the build it stands in for).
EMULATED_BUILDS: dict[str, tuple[tuple[str, ...], frozenset[str], str]] = {
    "avx2-vnni-emulated": (("-march=x86-64-v3", "-DIP_EMULATE_AVX_VNNI"), _X86_64_V3, "avx2-vnni"),
}


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERPLANE_NATIVE_DIR") or Path.home() / ".cache" / "inferplane" / "native")


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    line = _cpu_flags_line()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The builds this CPU can run, best first (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags() if flags is None else flags
    return [isa for isa, (_, needs) in ISA_BUILDS.items() if needs <= flags]


def emulated_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The test builds this CPU runs whose real build it cannot (where it can, that one is tested)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags() if flags is None else flags
    real = supported_isas(flags)
    return [name for name, (_, needs, stands_for) in EMULATED_BUILDS.items()
            if needs <= flags and stands_for not in real]


def source_files() -> list[Path]:
    """Every C file a build reads: SOURCE and the parts and headers beside it that it includes."""
    return sorted(path for path in SOURCE.parent.iterdir() if path.suffix in (".c", ".h") and path.is_file())


def source_digest() -> str:
    """SHA-256 of every C file's name and text, so an edit to any part or header makes a new build (and
    a new int8 conversion cache key, quant/startup_cache.py). Each name and text is framed by its
    length, so no two different sets of files hash alike."""
    h = hashlib.sha256()
    for path in source_files():
        data = path.read_bytes()
        h.update(f"{len(path.name)}:{path.name}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _compiler_flags(isa: str) -> tuple[str, ...]:
    return ISA_BUILDS[isa][0] if isa in ISA_BUILDS else EMULATED_BUILDS[isa][0]


def _build(compiler: str, isa: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, *_compiler_flags(isa), str(SOURCE), "-o", str(partial), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: workers starting together never load a half-written file


def library_path(compiler: str, isa: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([source_digest(), " ".join(FLAGS + _compiler_flags(isa)), version,
                                    _cpu_flags_line(), platform.machine()]).encode()).hexdigest()[:16]
    return _cache_dir() / f"kernels-{isa}-{key}.so"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _load(isa: str) -> NativeKernels | None:
    compiler = _compiler()
    if compiler is None:
        log.warning("native kernels: no C compiler found (set CC); decode runs on PyTorch ops, slower")
        return None
    try:
        path = library_path(compiler, isa)
        if not path.exists():
            _build(compiler, isa, path)
        loaded = NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native kernels unavailable, decode runs on PyTorch ops: %s", exc)
        return None
    if loaded.isa != isa:  # the compiler did not honour the flags: say so rather than mislabel
        log.warning("native kernels: asked for %s, the build reports %s", isa, loaded.isa)
    return loaded


@functools.cache
def kernels_for(isa: str) -> NativeKernels | None:
    """The build for one ISA (which this CPU must have), or one of EMULATED_BUILDS; None where it
    cannot be built or run."""
    if isa not in ISA_BUILDS and isa not in EMULATED_BUILDS:
        raise ValueError(f"unknown ISA {isa!r}; known: {', '.join([*ISA_BUILDS, *EMULATED_BUILDS])}")
    if isa not in supported_isas() and isa not in emulated_isas():
        return None
    return _load(isa)


def chosen_isa() -> str | None:
    """The ISA `kernels()` loads: INFERPLANE_NATIVE_ISA where the CPU has it, else the best one."""
    available = supported_isas()
    wanted = os.environ.get("INFERPLANE_NATIVE_ISA", "").strip()
    if wanted:
        if wanted in available:
            return wanted
        log.warning("INFERPLANE_NATIVE_ISA=%s: %s; using %s", wanted,
                    "not an ISA this CPU has" if wanted in ISA_BUILDS else f"unknown (known: {', '.join(ISA_BUILDS)})",
                    available[0] if available else "PyTorch ops")
    return available[0] if available else None


@functools.cache
def kernels() -> NativeKernels | None:
    """The kernels for this machine, built on first use; None where they cannot be (logged once)."""
    if os.environ.get("INFERPLANE_NATIVE", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        log.info("native kernels: not built for %s; using PyTorch ops", platform.machine())
        return None
    isa = chosen_isa()
    if isa is None:
        log.warning("native kernels: this CPU lacks AVX2 + FMA; decode runs on PyTorch ops, slower")
        return None
    return _load(isa)
