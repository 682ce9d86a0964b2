"""A block as the tiers store it: a fixed header, then the payload.

The header says what the payload is (the layout's fingerprint, the block's key, which pool's layers
it holds, its length) and holds an XXH3 checksum of it. `decode` gives the payload back only when
every field matches what the reader asked for and the checksum holds; anything else (a truncated
file, flipped bits, a block another model or configuration wrote, a file renamed to another key) is
a miss with its reason, so wrong KV can never reach a sequence.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import xxhash

from inferplane.api.kv_blocks import KEY_BYTES
from inferplane.worker.engine.kv.tiers.layout import KVLayout

MAGIC = b"IPKV"
VERSION = 1
# magic, version, part, layout fingerprint, key, payload length, payload checksum
HEADER = struct.Struct(f"<4sHH16s{KEY_BYTES}sQQ")


class Part(IntEnum):
    """Which pool's layers a record holds: the main pool's, or the sliding-window layers'."""

    MAIN = 0
    WINDOW = 1


@dataclass(frozen=True)
class Miss:
    """Why a stored record was not used."""

    reason: str


def encode(layout: KVLayout, key: bytes, payload: bytes | memoryview, part: Part = Part.MAIN) -> bytes:
    """The record of one block's payload (which must be the layout's size for that part)."""
    expected = layout.block_bytes(window=part is Part.WINDOW)
    if len(payload) != expected:
        raise ValueError(f"payload: {len(payload)} bytes, the layout's {part.name.lower()} block is {expected}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key: {KEY_BYTES} bytes, got {len(key)}")
    checksum = xxhash.xxh3_64_intdigest(payload)
    header = HEADER.pack(MAGIC, VERSION, part, layout.fingerprint(), key, len(payload), checksum)
    return header + bytes(payload)


def decode(layout: KVLayout, key: bytes, record: bytes | memoryview, part: Part = Part.MAIN) -> bytearray | Miss:
    """The payload of `record` if it is block `key`'s `part` under `layout`, intact; else a Miss."""
    if len(record) < HEADER.size:
        return Miss("truncated header")
    magic, version, stored_part, fingerprint, stored_key, length, checksum = HEADER.unpack_from(record)
    if magic != MAGIC or version != VERSION:
        return Miss("not a KV record of this version")
    if fingerprint != layout.fingerprint():
        return Miss("another layout (model digest, dtype, block size or layers)")
    if stored_key != key:
        return Miss("another block's key")
    if stored_part != part:
        return Miss("another pool's layers")
    if length != layout.block_bytes(window=part is Part.WINDOW) or len(record) != HEADER.size + length:
        return Miss("truncated or wrong length")
    payload = memoryview(record)[HEADER.size:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return Miss("checksum")
    return bytearray(payload)  # writable: the pool loads it through torch.frombuffer without a copy of its own
