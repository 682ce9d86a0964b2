"""The sliding layers' KV blocks: a second pool, of which each sequence keeps only its window.

Models with sliding-window layers (Gemma 2/3, Mistral, Phi-3 variants) attend, in those layers, only
to the last `window` positions. Their KV lives in its own pool (`PagedKVCache.window_data`) with its
own block table per sequence (`Sequence.window_table`), indexed like the main table (entry i holds
positions [i * block_size, (i + 1) * block_size)). Blocks that fell out of the window go back to the
pool and their entries become `NULL_BLOCK`, a block never handed out and never written (it stays
zero, so a masked read of it is finite).

Invariants:
- A sequence that has computed c tokens holds every window block with a position >= c - window
  (`first_needed`): the next step's queries (positions >= c - 1 for a fork or a prefix hit that
  recomputes one token, >= c otherwise) see keys back to c - window, so nothing they need is freed.
- Per sequence, the window table never holds more blocks than the main one (it is the same blocks
  less the freed ones), so a window pool as large as the main one can never run short first; the
  pool is smaller than that only by the bound `window_pool_blocks` proves.
- Reference counts as in the main pool: forks share window blocks, the radix tree keeps its own
  reference on those it caches; `NULL_BLOCK` is never retained or released.
"""

from __future__ import annotations

from inferplane.worker.engine.kv.block_pool import BlockPool
from inferplane.worker.engine.sequence import Sequence

NULL_BLOCK = 0


def first_needed(num_computed: int, window: int) -> int:
    """The first position whose keys a sequence with `num_computed` tokens may still read."""
    return max(0, num_computed - window)


def first_kept_block(num_computed: int, window: int, block_size: int) -> int:
    return first_needed(num_computed, window) // block_size


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Window blocks enough for any moment: each running sequence holds the blocks over
    [c - window, c + n) while it computes n tokens at c (at most window / block_size + 3 blocks plus
    n / block_size), and one step's n add up to at most max_num_batched_tokens. The null block is
    counted on top."""
    per_sequence = -(-window // block_size) + 3
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size) + 1


class WindowBlocks:
    """Allocation and trimming of the window pool for one KV manager."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        self.pool = BlockPool(num_blocks)
        if self.pool.allocate(1) != [NULL_BLOCK]:
            raise AssertionError("the window pool's first block must be the null block")
        self.block_size = block_size
        self.window = window
        self.peak_blocks_used = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def blocks_used(self) -> int:
        return self.pool.num_used - 1

    def missing(self, seq: Sequence, num_blocks: int) -> int:
        """Blocks `grow(seq, num_blocks)` would take from the pool."""
        return max(0, num_blocks - len(seq.window_table))

    def grow(self, seq: Sequence, num_blocks: int) -> None:
        """Extends the table to `num_blocks` entries; the caller checked `missing` against the pool."""
        needed = self.missing(seq, num_blocks)
        if needed:
            seq.window_table.extend(self.pool.allocate(needed))
            self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used())

    def trim(self, seq: Sequence) -> int:
        """Frees the blocks no later query of `seq` can read; returns how many."""
        table = seq.window_table
        first = min(first_kept_block(seq.num_computed_tokens, self.window, self.block_size), len(table))
        freed = 0
        for i in range(first):
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
                freed += 1
        return freed

    def share(self, source: list[int], count: int) -> list[int]:
        """The first `count` entries of `source`, with a reference taken on each real block."""
        shared = list(source[:count])
        for block in shared:
            if block != NULL_BLOCK:
                self.pool.retain(block)
        return shared

    def free(self, seq: Sequence) -> None:
        for block in seq.window_table:
            if block != NULL_BLOCK:
                self.pool.release(block)
        seq.window_table = []

    def stats(self) -> dict[str, int]:
        return {"window_blocks_total": self.num_blocks, "window_blocks_used": self.blocks_used(),
                "window_peak_blocks_used": self.peak_blocks_used}
