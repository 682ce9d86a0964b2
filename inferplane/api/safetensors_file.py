"""A safetensors file read as untrusted input, without torch: the whole file is checked against the
format before anything of it is used, and its tensors' values can be checked to be finite.

Why its own reader: a tenant supplies LoRA adapter files, and the registry (no torch) and the
workers must refuse the same files with the same words. The `safetensors` library checks less than
an isolated service needs (it accepts a 100 MiB header and NaN values) and fails with its own
internal error text; this reader answers `SafetensorsError` (a ValueError) naming the file and the
field, which callers turn into a 400.

What a file must be (the format: 8-byte little-endian header length N, N bytes of JSON, then the
data section):
- a regular file (a FIFO or a device is refused without being opened for a blocking read);
- N at most `MAX_HEADER_BYTES`, the header a JSON object of UTF-8 text, no key twice, no
  NaN/Infinity literals;
- `__metadata__`, where present, an object of strings;
- every other entry {"dtype", "shape", "data_offsets"}: dtype one of `FLOAT_DTYPES`, shape a list
  of at most `MAX_DIMS` non-negative integers (not booleans) each at most `MAX_DIM`, offsets two
  integers [begin, end] with end - begin = itemsize x the product of the shape;
- the tensors tile the data section exactly: sorted by offset each starts where the one before
  ended (the first at 0; no overlap, no hole), and the last ends at the end of the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

# A PEFT adapter's header holds ~150 bytes per tensor: every module of an 80-layer model at two
# tensors each is ~170 KiB. The format's own readers allow 100 MiB, which costs a JSON parse of that.
MAX_HEADER_BYTES = 1 << 20
MAX_DIMS = 4
MAX_DIM = 1 << 31
# (itemsize, the exponent bits of the unsigned view: all ones means infinity or NaN)
FLOAT_DTYPES: dict[str, tuple[int, int]] = {
    "F16": (2, 0x7C00),
    "BF16": (2, 0x7F80),
    "F32": (4, 0x7F800000),
    "F64": (8, 0x7FF0000000000000),
}
_UNSIGNED = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_CHUNK = 1 << 20  # bytes read at a time where values are only checked


class SafetensorsError(ValueError):
    """The file is not a safetensors file this reader accepts; the message names file and field."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int

    @property
    def itemsize(self) -> int:
        return FLOAT_DTYPES[self.dtype][0]


@dataclass(frozen=True)
class SafetensorsFile:
    """A checked header: the tensors by name, and the file's identity when it was read (a file
    changed since is refused when its data is read)."""

    path: Path
    size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def open_regular(path: Path, what: str) -> BinaryIO:
    """`path` opened for reading if it is a regular file (symlinks followed); SafetensorsError
    naming `what` otherwise. A FIFO or a device is refused from its stat, and the open itself is
    non-blocking and checked again, so nothing swapped in between can hang the caller.
    FileNotFoundError propagates (callers name the missing file their own way)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise SafetensorsError(f"{what} cannot be read: {_reason(exc)}") from None
    if not stat.S_ISREG(found.st_mode):
        raise SafetensorsError(f"{what} is not a regular file")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SafetensorsError(f"{what} cannot be read: {_reason(exc)}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SafetensorsError(f"{what} is not a regular file")
    return os.fdopen(fd, "rb")


def shown(text: str, limit: int = 96) -> str:
    """`text` cut to `limit` characters for an error message (names in a tenant's file are its own)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found: dict[str, object] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"key {key!r} appears twice")
        found[key] = value
    return found


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path: Path | str, what: str | None = None) -> SafetensorsFile:
    """The checked header of the safetensors file at `path` (see the module docstring); no tensor
    data is read. `what` names the file in errors (default: its name)."""
    path = Path(path)
    what = what or path.name
    with open_regular(path, what) as handle:
        size = os.fstat(handle.fileno()).st_size
        raw = handle.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{what} is not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{what}: its header is {length} bytes; at most {MAX_HEADER_BYTES} are read")
        if 8 + length > size:
            raise SafetensorsError(f"{what}: its header length {length} runs past the end of the file")
        text = handle.read(length)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_unique, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise SafetensorsError(f"{what}: the header is not valid JSON ({shown(str(exc))})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{what}: the header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{what}: __metadata__ must be an object of strings")
    tensors = {name: _tensor_info(what, name, entry, 8 + length) for name, entry in header.items()}
    _check_tiling(what, tensors, 8 + length, size)
    return SafetensorsFile(path=path, size=size, tensors=tensors, metadata=metadata)


def _tensor_info(what: str, name: str, entry: object, data_start: int) -> TensorInfo:
    where = f"{what}: tensor {shown(name)}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{where} must be an object of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in FLOAT_DTYPES:
        raise SafetensorsError(f"{where}: dtype {str(dtype)[:16]!r} is not served (one of {', '.join(FLOAT_DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(_is_int(d) and 0 <= d <= MAX_DIM for d in shape)):
        raise SafetensorsError(f"{where}: shape must be a list of at most {MAX_DIMS} whole numbers from 0 to "
                               f"{MAX_DIM}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) and o >= 0 for o in offsets):
        raise SafetensorsError(f"{where}: data_offsets must be two non-negative whole numbers")
    begin, end = offsets
    count = 1
    for d in shape:
        count *= d
    if end < begin or end - begin != count * FLOAT_DTYPES[dtype][0]:
        raise SafetensorsError(f"{where}: data_offsets [{begin}, {end}] do not hold a {dtype} tensor of shape "
                               f"{tuple(shape)}")
    return TensorInfo(dtype, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(what: str, tensors: dict[str, TensorInfo], data_start: int, size: int) -> None:
    at = data_start
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != at:
            kind = "overlaps the tensor before it" if info.begin < at else "leaves a gap before it"
            raise SafetensorsError(f"{what}: tensor {shown(name)} {kind} (data_offsets must tile the data section)")
        at = info.end
    if at != size:
        raise SafetensorsError(f"{what}: the tensors' data ends at byte {at} but the file has {size} bytes")


def nonfinite(dtype: str, data: bytes | bytearray | memoryview) -> bool:
    """Whether any value of `dtype` in `data` is infinite or NaN (exponent bits all ones), read as
    integers so no float arithmetic runs on the values."""
    itemsize, exponent = FLOAT_DTYPES[dtype]
    bits = np.frombuffer(data, dtype=_UNSIGNED[itemsize])
    mask = bits.dtype.type(exponent)
    return bool(np.any((bits & mask) == mask))


def _open_same(file: SafetensorsFile) -> BinaryIO:
    handle = open_regular(file.path, file.path.name)
    if os.fstat(handle.fileno()).st_size != file.size:
        handle.close()
        raise SafetensorsError(f"{file.path.name} changed while it was read")
    return handle


def check_finite(file: SafetensorsFile, names: Iterable[str] | None = None) -> None:
    """Reads every tensor (or those named) once, in chunks, and raises SafetensorsError naming the
    first that holds an infinity or a NaN."""
    wanted = file.tensors if names is None else {n: file.tensors[n] for n in names}
    with _open_same(file) as handle:
        for name, info in sorted(wanted.items(), key=lambda item: item[1].begin):
            handle.seek(info.begin)
            left = info.end - info.begin
            chunk = max(info.itemsize, _CHUNK // info.itemsize * info.itemsize)
            while left:
                data = handle.read(min(chunk, left))
                if not data:
                    raise SafetensorsError(f"{file.path.name} changed while it was read")
                if nonfinite(info.dtype, data):
                    raise SafetensorsError(f"{file.path.name}: tensor {shown(name)} holds an infinity or a NaN")
                left -= len(data)


def sha256(file: SafetensorsFile) -> str:
    """The hex sha256 of the whole file, read through the same regular-file open as its data."""
    digest = hashlib.sha256()
    with _open_same(file) as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_tensors(file: SafetensorsFile, names: Iterable[str]) -> Iterator[tuple[str, TensorInfo, bytearray]]:
    """Each named tensor's bytes (little-endian `info.dtype`), checked finite as they are read;
    SafetensorsError naming the first that is not."""
    with _open_same(file) as handle:
        for name in names:
            info = file.tensors[name]
            handle.seek(info.begin)
            data = bytearray(info.end - info.begin)
            if handle.readinto(data) != len(data):
                raise SafetensorsError(f"{file.path.name} changed while it was read")
            if nonfinite(info.dtype, data):
                raise SafetensorsError(f"{file.path.name}: tensor {shown(name)} holds an infinity or a NaN")
            yield name, info, data
