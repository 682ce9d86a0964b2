"""Reading weights for the registry.

A model is (name, version). Registering reads the weights once: the sha256 (compared with the one the
caller expects, if given), the size, and architecture and context length from `config.json` (a
Hugging Face folder) or the GGUF header (api/gguf_reader.py, as the workers read it; no torch). The
row's status says what came of it: `verified` (servable), `failed` (`status_detail` says why), or
`registered` (recorded, not yet checked).

The architecture is recorded by its canonical name with its kind, "generate" or "embedding"
(`inferplane.api.architectures`, the one list of what the workers load); weights of any other
architecture, or of none that the file names, are refused at registration (400 naming it, no row).
Rows from before kinds were recorded get theirs from the architecture as they are read.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from inferplane.api.architectures import (
    ARCHITECTURE_KINDS,
    canonical_architecture,
    config_architecture,
    model_kind,
    unsupported_message,
)
from inferplane.api.gguf_reader import open_gguf
from inferplane.control_plane.errors import InvalidInput
from inferplane.storage.digest import folder_files, sha256_file, sha256_folder

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


class CorruptWeights(InvalidInput):
    """The path has the right shape (GGUF magic, config.json) but its content cannot be read."""


class UnsupportedArchitecture(InvalidInput):
    """400: the weights are readable, but of an architecture the workers do not load (or name none)."""

    code = "unsupported_architecture"

    def __init__(self, message: str):
        super().__init__(message, param="source")


@dataclass(frozen=True)
class ModelMetadata:
    format: str  # "gguf" | "hf"
    sha256: str
    size_bytes: int
    architecture: str | None  # canonical once `inspect_model` has checked it; None on a pvc:// entry
    context_length: int | None
    kind: str | None = None  # "generate" | "embedding" (api/architectures.py)


def _read_gguf(path: Path) -> tuple[str | None, int | None]:
    """(architecture, context length) from the header, read as the workers read it (api/gguf_reader.py)."""
    fields = open_gguf(path).fields
    arch_field = fields.get("general.architecture")
    arch = str(arch_field.contents()) if arch_field is not None else None
    ctx_field = fields.get(f"{arch}.context_length") if arch else None
    ctx = int(ctx_field.contents()) if ctx_field is not None else None
    return arch, ctx


def _read_hf_config(folder: Path) -> tuple[str | None, int | None]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptWeights(f"unreadable config.json in {folder}: {e}") from None
    if not isinstance(config, dict):
        raise CorruptWeights(f"config.json in {folder} is not a JSON object")
    arch = config_architecture(config)  # the rule the workers read it by
    for scope in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(scope.get(key), int):
                return arch, scope[key]
    return arch, None


_cache: dict[tuple[str, int, int], ModelMetadata] = {}
_cache_lock = threading.Lock()


def detect_format(path: Path) -> str:
    """ "gguf" or "hf"; `InvalidInput` for anything else (nothing is recorded for those)."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidInput(
                f"{path} is a folder without config.json (expected a Hugging Face model folder)"
            )
        return "hf"
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise InvalidInput(f"{path} is neither a GGUF file nor a Hugging Face model folder")
    return "gguf"


def _served(meta: ModelMetadata) -> ModelMetadata:
    """`meta` with its architecture canonical and its kind; `UnsupportedArchitecture` (naming it) if
    the workers load no such architecture, or the weights name none."""
    canonical = canonical_architecture(meta.architecture)
    if canonical is not None:
        return replace(meta, architecture=canonical, kind=model_kind(canonical))
    if meta.architecture is None:
        where = "general.architecture" if meta.format == "gguf" else "config.json's model_type and architectures"
        raise UnsupportedArchitecture(f"the weights name no architecture ({where} missing); supported: "
                                      f"{', '.join(sorted(ARCHITECTURE_KINDS))}")
    raise UnsupportedArchitecture(unsupported_message(meta.architecture))


def inspect_model(path: Path, *, use_cache: bool = True) -> ModelMetadata:
    """Format, checksum, size, canonical architecture and its kind, context length of weights at `path`.

    GGUF results are cached per (path, size, mtime) in this process: hashing a real model's file takes
    seconds (its header is read once per process too, api/gguf_reader.open_gguf). Folders are
    not cached (their mtime does not move when a file inside is rewritten). `CorruptWeights` if the
    format is right but the content unreadable; `UnsupportedArchitecture` if it is readable but of
    an architecture the workers do not load (both are `InvalidInput`).
    """
    fmt = detect_format(path)
    if fmt == "hf":
        arch, ctx = _read_hf_config(path)
        checked = _served(ModelMetadata("hf", "", 0, arch, ctx))  # refused before the folder is hashed
        files = folder_files(path)
        size = sum(p.stat().st_size for p in files)
        return replace(checked, sha256=sha256_folder(path, files), size_bytes=size)
    stat = path.stat()
    cache_key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if use_cache and cache_key in _cache:
            return _cache[cache_key]
    try:
        arch, ctx = _read_gguf(path)
    except Exception as e:  # a truncated or corrupt file: gguf raises assorted errors
        raise CorruptWeights(f"unreadable GGUF metadata in {path}: {e}") from None
    checked = _served(ModelMetadata("gguf", "", stat.st_size, arch, ctx))
    meta = replace(checked, sha256=sha256_file(path))
    with _cache_lock:
        _cache[cache_key] = meta
    return meta


def clear_inspect_cache() -> None:
    """Forgets cached checksums (tests that rewrite a file within one mtime tick call this)."""
    with _cache_lock:
        _cache.clear()
