"""GGUF files read for the registry and the worker alike: metadata as Python values, tensors as views.

Why not `gguf.GGUFReader`: it makes a numpy view per metadata array element (two per string) and
joins them again on every `contents()`, 2.7 s for SmolLM2's 49k-token vocabulary and merges, most
of a CPU worker's start-up; making it faster meant overriding its private methods, which any gguf
release may rename. The format itself is small and versioned (GGUF v2/v3, little-endian): a
header, key/value metadata, a tensor table, aligned tensor data. Here each metadata array becomes
one Python list as it is read, and each tensor a numpy view of the memory-mapped file in the shape
`gguf.GGUFReader` gives it (element counts for float/int types, bytes per block row for quantized
ones), so its consumers are unchanged. The `gguf` package still names the tensor types and their
block sizes. Imports no torch: the registry reads headers with it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (the spec's numbering): numpy dtype of each scalar type.
_SCALARS: dict[int, np.dtype] = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
    5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain elements rather than blocks (gguf.GGUFReader's rule).
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader can read (bad magic, unknown version, truncated, big-endian)."""


@dataclass(frozen=True)
class GGUFField:
    """One metadata key's value: a scalar, a string, or a list (an array)."""

    name: str
    value: Any

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        """The value (`gguf.ReaderField.contents`' meaning): an array's items by index or slice."""
        return self.value[index_or_slice] if isinstance(self.value, list) else self.value


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
    def __init__(self, data: np.ndarray):
        self.data, self.raw, self.at = data, memoryview(data), 0

    def scalar(self, kind: int) -> Any:
        dtype = _SCALARS[kind]
        value = np.frombuffer(self.raw, dtype=dtype, count=1, offset=self.at)[0]
        self.at += dtype.itemsize
        return value.item()

    def u32(self) -> int:
        return self.scalar(4)

    def u64(self) -> int:
        return self.scalar(10)

    def string(self) -> str:
        size = self.u64()
        text = bytes(self.raw[self.at:self.at + size]).decode("utf-8")
        self.at += size
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.u32(), self.u64()
            if item in _SCALARS:  # numbers in one pass
                dtype = _SCALARS[item]
                values = np.frombuffer(self.raw, dtype=dtype, count=count, offset=self.at).tolist()
                self.at += count * dtype.itemsize
                return values
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.at}")
        return self.scalar(kind)


class GGUFFile:
    """A GGUF file's metadata (`fields`: name -> GGUFField) and tensors (`tensors`, in file order)."""

    def __init__(self, path: str | os.PathLike[str]):
        import gguf

        self.path = str(path)
        self.data = np.memmap(self.path, mode="r")
        try:
            self._read(gguf)
        except (IndexError, ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    def _read(self, gguf: Any) -> None:
        cursor = _Cursor(self.data)
        if bytes(cursor.raw[:4]) != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        cursor.at = 4
        version = cursor.u32()
        if version not in VERSIONS:
            big_endian = version & 0xFFFF == 0
            raise GGUFFormatError(f"{self.path}: " + ("a big-endian GGUF file" if big_endian else
                                                      f"GGUF version {version}") + " is not supported")
        tensor_count, kv_count = cursor.u64(), cursor.u64()
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            name = cursor.string()
            self.fields[name] = GGUFField(name, cursor.value(cursor.u32()))
        table = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = np.array([cursor.u64() for _ in range(cursor.u32())], dtype=np.uint64)
            table.append((name, dims, cursor.u32(), cursor.u64()))
        alignment = self.fields["general.alignment"].value if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment must be a power of two, got {alignment!r}")
        self.data_offset = -(-cursor.at // alignment) * alignment
        self.tensors = [self._tensor(gguf, *entry) for entry in table]

    def _tensor(self, gguf: Any, name: str, dims: np.ndarray, type_id: int, offset: int) -> GGUFTensor:
        kind = gguf.GGMLQuantizationType(type_id)
        n_elements = int(np.prod(dims))
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        shape = tuple(reversed(dims.tolist()))
        at = self.data_offset + offset
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
