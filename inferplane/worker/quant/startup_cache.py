"""The cpu-int8 conversion, kept on disk so that a worker's second start skips it.

A first start calibrates (a float forward over 512 tokens), smooths, quantizes, and scores the
quality gate (a float and an int8 forward): about 2.5 s of a 5 s start for SmolLM2 on this project's
machine, and minutes on a CPU where PyTorch's int8 ops were slow. What it produces depends only
on the model file's bytes, the conversion settings and the conversion code, so it is stored under a
key made of those three: the model's SHA-256 (computed once per file and remembered by path, size
and modification time), the settings, and a hash of the modules that do the conversion. A change
to any of them misses the cache; a file that does not load is recomputed and replaced.

What is stored is plain int8 weights and file blocks, not a kernel's packed layout, plus the gate's
figures, which were measured on these exact weights and on one kernel build: the settings name
that build (convert.cache_settings), so a start on another build measures its own. A restored
start reports `startup_cache_hit` 1 and the stored gate figures. The directory is `INFERPLANE_QUANT_CACHE`
(default `~/.cache/inferplane/quant`); `INFERPLANE_QUANT_CACHE=off` disables it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from inferplane.worker.ops.native.build import source_digest as native_source_digest

log = logging.getLogger(__name__)

# What the conversion and its gate figures depend on: these modules, and the kernels they ran on (every C
# file of them: native_source_digest).
_CODE = ("convert.py", "smooth.py", "int8_linear.py", "block_linear.py", "gguf_q8.py", "gguf_blocks.py", "gate.py",
         "startup_cache.py")
_FORMAT = 1


def cache_dir() -> Path | None:
    configured = os.environ.get("INFERPLANE_QUANT_CACHE", "")
    if configured.lower() in ("off", "0", "none"):
        return None
    return Path(configured) if configured else Path.home() / ".cache" / "inferplane" / "quant"


def _atomic_write(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        write(partial)
        os.replace(partial, target)  # workers starting together never read a half-written file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def file_digest(path: str, directory: Path) -> str:
    """The file's SHA-256, remembered by (real path, size, mtime) in directory/digests.json."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = f"{real}\0{st.st_size}\0{st.st_mtime_ns}"
    index_path = directory / "digests.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if stamp in index:
        return index[stamp]
    h = hashlib.sha256()
    with open(real, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    index[stamp] = h.hexdigest()
    _atomic_write(index_path, lambda p: Path(p).write_text(json.dumps(index, indent=1)))
    return index[stamp]


def conversion_code_hash() -> str:
    """What the int8 conversion's result depends on beside the file and settings: its code and the
    C kernels' sources (the KV tiers name a model's KV by it too)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _CODE:
        h.update((here / name).read_bytes())
    h.update(native_source_digest().encode())
    return h.hexdigest()[:16]


class ConversionCache:
    """One model file + settings: where its conversion is (or will be) stored."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def for_model(cls, model_path: str | None, settings: dict[str, Any]) -> ConversionCache | None:
        """None where caching is off or the model is not one file (an HF folder is not hashed)."""
        directory = cache_dir()
        if directory is None or not model_path or not os.path.isfile(model_path):
            return None
        try:
            digest = file_digest(model_path, directory)
        except OSError as exc:
            log.warning("int8 start-up cache off: %s", exc)
            return None
        key = hashlib.sha256(json.dumps({"model": digest, "settings": settings, "code": conversion_code_hash(),
                                         "format": _FORMAT}, sort_keys=True).encode()).hexdigest()[:24]
        return cls(directory / f"{digest[:16]}-{key}.pt")

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: recompute and replace it
            log.warning("int8 start-up cache %s unreadable, converting again: %s", self.path, exc)
            return None

    def save(self, payload: dict[str, Any]) -> None:
        try:
            _atomic_write(self.path, lambda p: torch.save(payload, p))
        except OSError as exc:  # a read-only or full disk costs the next start time, nothing else
            log.warning("int8 start-up cache not written (%s): %s", self.path, exc)
