"""PagedKV: every sequence owns its blocks outright; nothing is shared or kept after it ends."""

from __future__ import annotations

from inferplane.worker.kv.block_pool import BlockPool
from inferplane.worker.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class PagedKV:
    name = "paged"

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.peak_blocks_used = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_used(self) -> int:
        return self.pool.num_used

    def match_prefix(self, seq: Sequence) -> None:
        """Paged keeps no prefix cache: a new sequence starts from token 0."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for `num_new_tokens` more computed tokens; False (nothing changed) if short."""
        needed = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used())
        return True

    def on_computed(self, seq: Sequence) -> None:
        """Called after a step computed tokens of `seq`; the radix manager caches them here."""

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.pool.release(block)
        seq.block_table = []

    def stats(self) -> dict[str, int]:
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_used": self.blocks_used(),
            "peak_blocks_used": self.peak_blocks_used,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
        }
