"""The bridge between the KV pool's tensors and the tiers: what a KV manager calls to save a block
as it is computed and to load one back into a free block.

The managers own block ids only; this object is the one place their tier traffic touches tensors
(ops/kv_cache.py's `block_payload` and `load_block`), as the engine is for a fork's `BlockCopy`.
"""

from __future__ import annotations

from collections.abc import Sequence

from inferplane.worker.engine.kv.tiers.record import Part
from inferplane.worker.engine.kv.tiers.store import TieredKVStore
from inferplane.worker.ops.kv_cache import PagedKVCache


class TierLink:
    def __init__(self, store: TieredKVStore, cache: PagedKVCache):
        self.store = store
        self.cache = cache
        self.saved_blocks = 0
        self.loaded_blocks = 0

    def save(self, key: bytes, block: int, window_block: int | None = None) -> None:
        """Stores pool block `block` (full, computed, no longer written) under `key`, and the sliding
        layers' block `window_block` beside it where the sequence still holds one; a part some tier
        holds already is skipped: the same key is the same tokens under the same namespace."""
        if self.store.where(key) is None:
            self.store.put(key, self.cache.block_payload(block))
            self.saved_blocks += 1
        if window_block is not None and self.store.where(key, Part.WINDOW) is None:
            self.store.put(key, self.cache.block_payload(window_block, window=True), Part.WINDOW)

    def held_run(self, keys: Sequence[bytes], start: int) -> int:
        """How many of `keys[start:]`, in a row from `start`, some tier holds."""
        run = 0
        for key in keys[start:]:
            if self.store.where(key) is None:
                break
            run += 1
        return run

    def holds_window(self, key: bytes) -> bool:
        return self.store.where(key, Part.WINDOW) is not None

    def load(self, key: bytes, block: int, window: bool = False) -> bool:
        """Block `key`'s KV (its sliding layers' part, with `window`) into pool block `block`; False
        (the block untouched) on a miss or a record that fails its checks."""
        payload = self.store.get(key, Part.WINDOW if window else Part.MAIN)
        if payload is None:
            return False
        self.cache.load_block(block, payload, window)
        self.loaded_blocks += not window
        return True

    def stats(self) -> dict[str, float]:
        return {**self.store.stats(), "kv_tier_saved_blocks_total": float(self.saved_blocks),
                "kv_tier_loaded_blocks_total": float(self.loaded_blocks)}
