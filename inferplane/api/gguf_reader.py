"""GGUF files read for the registry and the worker alike: metadata on demand, tensors as views.

Why not `gguf.GGUFReader`: it makes a numpy view per metadata array element (two per string) and
joins them again on every `contents()`, 2.7 s for SmolLM2's 49k-token vocabulary and merges, most
of a CPU worker's start-up; making it faster meant overriding its private methods, which any gguf
release may rename. The format itself is small and versioned (GGUF v2/v3, little-endian): a
header, key/value metadata, a tensor table, aligned tensor data.

What a read costs is what the reader asks for, not what the file holds: opening a file walks the
metadata once, checking it against the bounds below, and keeps numbers and short strings; an array
(a tokenizer's vocabulary: 50k-260k strings) or a long string is kept as its place in the
memory-mapped file and read when `contents()` asks, each time (nothing is held in the per-process
cache). The control plane reads a few scalar keys, so a file with a huge metadata array costs it a
walk of the array's length fields and no Python object per element; the worker reads the tokenizer
arrays it needs. The tensor table is read on first use of `tensors`, each tensor a numpy view of
the file in the shape `gguf.GGUFReader` gives it (element counts for float/int types, bytes per
block row for quantized ones), so its consumers are unchanged. The `gguf` package still names the
tensor types and their block sizes. Imports no torch: the registry reads headers with it.

Bounds (`GGUFLimitError`, a `GGUFFormatError`, naming the file and the key): at most `MAX_KEYS`
keys, keys unique and at most `MAX_KEY_BYTES` long (the GGUF spec's limit), strings at most
`MAX_STRING_BYTES` (a whole tokenizer.json fits), arrays at most `MAX_ARRAY_LENGTH` elements and
`MAX_ARRAY_DEPTH` levels of arrays of arrays, at most `MAX_TENSORS` tensors of at most `MAX_DIMS`
dimensions (llama.cpp's GGML_MAX_DIMS). Real models are far inside: ~30-60 keys, vocabularies and
merge lists up to ~300k entries, chat templates of a few KiB, hundreds to a few thousand tensors.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

MAX_KEYS = 4096
MAX_KEY_BYTES = 65535
MAX_STRING_BYTES = 64 << 20
MAX_ARRAY_LENGTH = 1 << 22
MAX_ARRAY_DEPTH = 4
MAX_TENSORS = 65536
MAX_DIMS = 4
# Strings up to this long are decoded as the file is opened; longer ones when asked for.
_EAGER_STRING_BYTES = 4096

# GGUF metadata value types (the spec's numbering): numpy dtype of each scalar type.
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
    5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRUCTS = {kind: struct.Struct("<" + code) for kind, code in {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}.items()}
_U32, _U64 = _STRUCTS[4], _STRUCTS[10]
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain elements rather than blocks (gguf.GGUFReader's rule).
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader can read (bad magic, unknown version, truncated, big-endian)."""


class GGUFLimitError(GGUFFormatError):
    """The file's metadata or tensor table is over one of this module's bounds; `key` names the
    metadata key (or tensor) at fault where there is one."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class _Stored:
    """A value left in the file: a string or an array (of `item`s, `count` of them) at `offset`."""

    raw: memoryview
    kind: int
    item: int
    count: int
    offset: int
    end: int
    path: str
    key: str

    def read(self, index_or_slice: int | slice = slice(None)) -> Any:
        try:
            if self.kind == _STRING:
                return str(self.raw[self.offset:self.offset + self.count], "utf-8")
            if self.item in _SCALARS:  # numbers in one pass; one element without the rest
                view = np.frombuffer(self.raw, dtype=_SCALARS[self.item], count=self.count, offset=self.offset)
                return view[index_or_slice].tolist()
            # One copy of the array's bytes, then plain bytes slicing: faster than a view per string.
            return _read_array(bytes(self.raw[self.offset:self.end]), self.item, self.count, 0)[0][index_or_slice]
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{self.path}: metadata {self.key} is not valid UTF-8 ({exc})") from None


def _read_array(raw: bytes | memoryview, item: int, count: int, at: int) -> tuple[list, int]:
    """An array's elements as Python values (its bounds were checked when the file was opened)."""
    if item in _SCALARS:
        dtype = _SCALARS[item]
        return np.frombuffer(raw, dtype=dtype, count=count, offset=at).tolist(), at + count * dtype.itemsize
    values: list = []
    append = values.append
    if item == _STRING:
        unpack = _U64.unpack_from
        for _ in range(count):
            size = unpack(raw, at)[0]
            at += 8
            append(str(raw[at:at + size], "utf-8"))
            at += size
        return values, at
    for _ in range(count):  # arrays of arrays
        sub_item, sub_count = _U32.unpack_from(raw, at)[0], _U64.unpack_from(raw, at + 4)[0]
        value, at = _read_array(raw, sub_item, sub_count, at + 12)
        append(value)
    return values, at


class GGUFField:
    """One metadata key's value: a scalar, a string, or a list (an array), read when asked for."""

    __slots__ = ("name", "_value", "_stored")

    def __init__(self, name: str, value: Any = None, stored: _Stored | None = None):
        self.name, self._value, self._stored = name, value, stored

    @property
    def value(self) -> Any:
        """The whole value (an array as a list, read from the file on each call)."""
        return self.contents()

    @property
    def length(self) -> int | None:
        """An array's number of elements without reading them; None for a scalar or string."""
        return self._stored.count if self._stored is not None and self._stored.kind == _ARRAY else None

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value (`gguf.ReaderField.contents`' meaning): an array's items by index or slice."""
        if self._stored is None:
            return self._value
        if self._stored.kind == _STRING:
            return self._stored.read()
        return self._stored.read(index_or_slice)

    def __repr__(self) -> str:
        shown = self._value if self._stored is None else f"<{self._stored.count} stored>"
        return f"GGUFField({self.name!r}, {shown!r})"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in the file's order (fastest-varying first), `data` a view of the file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Walks the header, checking each length against the bounds and the file's end before use."""

    def __init__(self, raw: memoryview, path: str):
        self.raw, self.at, self.path, self.size = raw, 0, path, len(raw)
        self.key: str | None = None  # the key being read, for messages

    def limit(self, what: str, value: int, bound: int) -> None:
        if value > bound:
            where = f" ({self.key})" if self.key else ""
            raise GGUFLimitError(f"{self.path}: {what}{where} is {value}, over this reader's bound of {bound}",
                                 self.key)

    def need(self, size: int) -> None:
        if self.at + size > self.size:
            where = f" in {self.key}" if self.key else ""
            raise GGUFFormatError(f"{self.path}: the file ends at byte {self.size}{where} (truncated?)")

    def scalar(self, kind: int) -> Any:
        packer = _STRUCTS[kind]
        self.need(packer.size)
        value = packer.unpack_from(self.raw, self.at)[0]
        self.at += packer.size
        return value

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self, bound: int = MAX_STRING_BYTES, what: str = "a string's length") -> str:
        size = self.u64()
        self.limit(what, size, bound)
        self.need(size)
        text = str(self.raw[self.at:self.at + size], "utf-8")
        self.at += size
        return text

    def field(self, name: str) -> GGUFField:
        kind = self.u32()
        if kind in _SCALARS:
            return GGUFField(name, self.scalar(kind))
        if kind == _STRING:
            size = self.u64()
            self.limit("a string's length", size, MAX_STRING_BYTES)
            self.need(size)
            stored = _Stored(self.raw, _STRING, _STRING, size, self.at, self.at + size, self.path, name)
            self.at += size
            if size <= _EAGER_STRING_BYTES:
                return GGUFField(name, stored.read())  # checked now: most keys are short strings
            return GGUFField(name, stored=stored)
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            start = self.at
            self.skip_array(item, count, 1)
            return GGUFField(name, stored=_Stored(self.raw, _ARRAY, item, count, start, self.at, self.path, name))
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind} in {name} at byte {self.at}")

    def skip_array(self, item: int, count: int, depth: int) -> None:
        """Moves past an array, checking its bounds: numbers by arithmetic, strings by their
        length fields alone (nothing is decoded), arrays of arrays level by level."""
        self.limit("an array's length", count, MAX_ARRAY_LENGTH)
        if item in _SCALARS:
            size = count * _SCALARS[item].itemsize
            self.need(size)
            self.at += size
        elif item == _STRING:
            at, end, unpack = self.at, self.size, _U64.unpack_from
            for _ in range(count):
                if at + 8 > end:
                    break
                size = unpack(self.raw, at)[0]
                if size > MAX_STRING_BYTES:
                    self.limit("a string's length", size, MAX_STRING_BYTES)
                at += 8 + size
            else:
                self.at = at
                self.need(0)  # the last string runs past the end?
                return
            self.at = at
            self.need(8)  # a length field cut off: raises
        elif item == _ARRAY:
            self.limit("arrays' nesting depth", depth + 1, MAX_ARRAY_DEPTH)
            for _ in range(count):
                sub_item, sub_count = self.u32(), self.u64()
                self.skip_array(sub_item, sub_count, depth + 1)
        else:
            raise GGUFFormatError(f"{self.path}: unknown array element type {item} in {self.key}")


class GGUFFile:
    """A GGUF file's metadata (`fields`: name -> GGUFField, read as the file is opened) and tensors
    (`tensors`, in file order, read on first use)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        try:
            self.data = np.memmap(self.path, mode="r")
            self._read_metadata()
        except GGUFFormatError:
            raise
        except (IndexError, ValueError, UnicodeDecodeError, struct.error) as exc:
            raise GGUFFormatError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    def _read_metadata(self) -> None:
        cursor = _Cursor(memoryview(self.data), self.path)
        cursor.need(4)
        if bytes(cursor.raw[:4]) != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        cursor.at = 4
        version = cursor.u32()
        if version not in VERSIONS:
            big_endian = version & 0xFFFF == 0
            raise GGUFFormatError(f"{self.path}: " + ("a big-endian GGUF file" if big_endian else
                                                      f"GGUF version {version}") + " is not supported")
        self._tensor_count, kv_count = cursor.u64(), cursor.u64()
        cursor.limit("the number of metadata keys", kv_count, MAX_KEYS)
        cursor.limit("the number of tensors", self._tensor_count, MAX_TENSORS)
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            cursor.key = None
            name = cursor.string(MAX_KEY_BYTES, "a metadata key's length")
            cursor.key = name
            if name in self.fields:
                raise GGUFFormatError(f"{self.path}: metadata key {name} appears twice")
            self.fields[name] = cursor.field(name)
        self._table_at = cursor.at

    @functools.cached_property
    def _table(self) -> tuple[int, list[GGUFTensor]]:
        import gguf

        try:
            return self._read_table(gguf)
        except GGUFFormatError:
            raise
        except (IndexError, ValueError, UnicodeDecodeError, struct.error) as exc:
            raise GGUFFormatError(f"{self.path}: not a readable GGUF tensor table ({exc})") from exc

    @property
    def tensors(self) -> list[GGUFTensor]:
        return self._table[1]

    @property
    def data_offset(self) -> int:
        """Where the tensor data starts (past the tensor table, aligned)."""
        return self._table[0]

    def _read_table(self, gguf: Any) -> tuple[int, list[GGUFTensor]]:
        cursor = _Cursor(memoryview(self.data), self.path)
        cursor.at = self._table_at
        table = []
        for _ in range(self._tensor_count):
            cursor.key = None
            name = cursor.string(MAX_KEY_BYTES, "a tensor name's length")
            cursor.key = f"tensor {name}"
            n_dims = cursor.u32()
            cursor.limit("the number of dimensions", n_dims, MAX_DIMS)
            dims = np.array([cursor.u64() for _ in range(n_dims)], dtype=np.uint64)
            table.append((name, dims, cursor.u32(), cursor.u64()))
        field = self.fields.get("general.alignment")
        alignment = DEFAULT_ALIGNMENT if field is None else field.contents()
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment must be a power of two, got {alignment!r}")
        data_offset = -(-cursor.at // alignment) * alignment
        return data_offset, [self._tensor(gguf, data_offset, *entry) for entry in table]

    def _tensor(self, gguf: Any, data_offset: int, name: str, dims: np.ndarray, type_id: int,
                offset: int) -> GGUFTensor:
        kind = gguf.GGMLQuantizationType(type_id)
        n_elements = math.prod(dims.tolist())  # Python ints: no wrap-around on absurd dimensions
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        shape = tuple(reversed(dims.tolist()))
        at = data_offset + offset
        if kind.name in _PLAIN:
            dtype, count = np.dtype(_PLAIN[kind.name]), n_elements
        else:
            dtype, count = np.dtype(np.uint8), n_bytes
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
        if at + count * dtype.itemsize > len(self.data):
            raise GGUFFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(self.data, dtype=dtype, count=count, offset=at).reshape(shape)
        return GGUFTensor(name, kind, dims, n_elements, n_bytes, at, data)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The file, read once per process while it is unchanged (same size and mtime): loading a model,
    its tokenizer and its weight blocks, and the registry's inspection, all read it."""
    st = os.stat(path)
    return _open(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: str, _size: int, _mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)
