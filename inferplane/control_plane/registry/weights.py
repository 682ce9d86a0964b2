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

What the weights say is checked before it is recorded, with a 400 naming the file and the field
(`InvalidMetadata`, nothing recorded): the context length must be a whole number of tokens from 1
to `MAX_CONTEXT_LENGTH`; a GGUF header must be inside the reader's bounds (api/gguf_reader.py:
number of keys, key and string lengths, array lengths); a config.json at most `MAX_CONFIG_BYTES`.
Reading a GGUF header here costs a walk over its length fields and the few scalar keys read, never
a Python object per array element (the tokenizer arrays stay in the file).
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
from inferplane.api.gguf_reader import GGUFField, GGUFLimitError, open_gguf
from inferplane.control_plane.errors import InvalidInput
from inferplane.storage.digest import folder_files, sha256_file, sha256_folder

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# 2**24 = 16,777,216 tokens: the longest contexts models claim (10M) fit; anything longer is no
# model's, and a negative, zero or 64-bit value would reach the database and the schedulers.
MAX_CONTEXT_LENGTH = 1 << 24
# A model's config.json is a few KiB; this bounds what reading one may cost the gateway.
MAX_CONFIG_BYTES = 4 << 20


class CorruptWeights(InvalidInput):
    """The path has the right shape (GGUF magic, config.json) but its content cannot be read."""


class InvalidMetadata(InvalidInput):
    """400: the weights' metadata is readable but out of bounds (an absurd context length, a GGUF
    header over the reader's limits); the message names the file and the field."""

    code = "invalid_model_metadata"

    def __init__(self, message: str):
        super().__init__(message, param="source")


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
    # Whether the tokenizer carries a chat template: a chat model answers /v1/chat/completions, a
    # base model only /v1/completions (`models list` says which). None: not read (a pvc:// entry).
    chat_template: bool | None = None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def context_length(value: object, where: str) -> int:
    """`value` as a context length, or `InvalidMetadata` naming `where` (the file and its key)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONTEXT_LENGTH:
        raise InvalidMetadata(f"{where} is {_shown(value)}: a context length must be a whole number of tokens "
                              f"from 1 to {MAX_CONTEXT_LENGTH}")
    return value


def _scalar(field: GGUFField | None, where: str) -> object:
    """A scalar key's value (None when absent); an array there is refused unread."""
    if field is None:
        return None
    if field.length is not None:
        raise InvalidMetadata(f"{where} is an array of {field.length} elements, not a single value")
    return field.contents()


def _read_gguf(path: Path) -> tuple[str | None, int | None, bool]:
    """(architecture, context length, has a chat template) from the header, read as the workers read
    it (api/gguf_reader.py): two scalar keys and whether `tokenizer.chat_template` is there (the
    worker's tokenizer reads that key); the arrays are only walked past."""
    try:
        fields = open_gguf(path).fields
    except GGUFLimitError as e:
        raise InvalidMetadata(f"GGUF metadata over the registry's bounds: {e}") from None
    chat = "tokenizer.chat_template" in fields
    arch = _scalar(fields.get("general.architecture"), f"{path}: general.architecture")
    if arch is not None and (not isinstance(arch, str) or len(arch) > 256):
        raise InvalidMetadata(f"{path}: general.architecture is {_shown(arch)}, not an architecture name")
    if not arch:
        return None, None, chat
    key = f"{arch}.context_length"
    ctx = _scalar(fields.get(key), f"{path}: {key}")
    return arch, None if ctx is None else context_length(ctx, f"{path}: {key}"), chat


def _hf_chat_template(folder: Path) -> bool:
    """Whether a Hugging Face folder's tokenizer has a chat template where the worker's tokenizer
    looks (worker/model/tokenizer.load_hf_tokenizer): tokenizer_config.json's `chat_template`, else
    chat_template.jinja. An unreadable tokenizer_config.json counts as none (the worker refuses it)."""
    if (folder / "chat_template.jinja").is_file():
        return True
    config_file = folder / "tokenizer_config.json"
    try:
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            return False
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _read_hf_config(folder: Path) -> tuple[str | None, int | None]:
    config_file = folder / "config.json"
    try:
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidMetadata(f"{config_file} is {config_file.stat().st_size} bytes, over the registry's "
                                  f"bound of {MAX_CONFIG_BYTES} for a model's config.json")
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptWeights(f"unreadable config.json in {folder}: {e}") from None
    if not isinstance(config, dict):
        raise CorruptWeights(f"config.json in {folder} is not a JSON object")
    arch = config_architecture(config)  # the rule the workers read it by
    text_config = config.get("text_config")
    for prefix, scope in (("", config), ("text_config.", text_config if isinstance(text_config, dict) else {})):
        for key in _CONTEXT_KEYS:
            if scope.get(key) is not None:
                return arch, context_length(scope[key], f"{config_file}: {prefix}{key}")
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
        # refused before the folder is hashed
        checked = _served(ModelMetadata("hf", "", 0, arch, ctx, chat_template=_hf_chat_template(path)))
        files = folder_files(path)
        size = sum(p.stat().st_size for p in files)
        return replace(checked, sha256=sha256_folder(path, files), size_bytes=size)
    stat = path.stat()
    cache_key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _cache_lock:
        if use_cache and cache_key in _cache:
            return _cache[cache_key]
    try:
        arch, ctx, chat = _read_gguf(path)
    except InvalidMetadata:
        raise
    except Exception as e:  # a truncated or corrupt file: the reader raises GGUFFormatError
        raise CorruptWeights(f"unreadable GGUF metadata in {path}: {e}") from None
    checked = _served(ModelMetadata("gguf", "", stat.st_size, arch, ctx, chat_template=chat))
    meta = replace(checked, sha256=sha256_file(path))
    with _cache_lock:
        _cache[cache_key] = meta
    return meta


def clear_inspect_cache() -> None:
    """Forgets cached checksums (tests that rewrite a file within one mtime tick call this)."""
    with _cache_lock:
        _cache.clear()
