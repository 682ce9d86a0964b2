"""What a stored block's bytes mean, and the fingerprint that keeps other meanings out.

A block's payload is the K and V of every layer for `block_size` tokens, in the pool's dtype and
shape. Read under another model (weights digest), dtype, block size or layer layout it would be
wrong KV that no check downstream could notice, so each record carries the fingerprint of the
layout it was written under and a reader with another fingerprint treats it as a miss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVLayout:
    """The KV of one model under one engine configuration.

    `layers` counts the layers kept in the main pool; `window_layers` those kept in the sliding
    window pool (a block's record holds the main pool's layers; windows are stored apart).
    """

    model_digest: str
    dtype: str
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    window_layers: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for name in ("block_size", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layers < 0 or self.window_layers < 0 or self.layers + self.window_layers == 0:
            raise ValueError(f"layers: {self.layers} full and {self.window_layers} sliding; at least one")

    def fingerprint(self) -> bytes:
        """16 bytes that differ for any two layouts (the header's check, the disk tier's folder)."""
        canonical = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(canonical, digest_size=16).digest()

    def block_bytes(self, window: bool = False) -> int:
        """One block's payload: K and V of each layer of the main pool (or of the window pool)."""
        layers = self.window_layers if window else self.layers
        return layers * 2 * self.block_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
