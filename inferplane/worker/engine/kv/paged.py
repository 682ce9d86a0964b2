"""PagedKV: every sequence owns its blocks outright; nothing is shared or kept after it ends.

Models with sliding-window layers keep those layers' KV in a second pool (kv/window.py): each
sequence holds there only the blocks its window still reaches, and frees the rest after every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferplane.worker.engine.kv.block_pool import BlockPool
from inferplane.worker.engine.kv.window import WindowBlocks
from inferplane.worker.engine.sequence import Sequence


@dataclass(frozen=True)
class BlockCopy:
    """One block's KV copied into another, in every layer of the main pool or of the window pool."""

    source: int
    destination: int
    window: bool = False


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def fork_layout(prompt_len: int, block_size: int) -> tuple[int, bool]:
    """How a fork shares a computed prompt: (whole blocks before the last prompt token, which the
    child shares read-only; whether the block holding that token is partly filled, so the child
    needs its own copy of it). The child then recomputes only the last prompt token, whose logits
    it samples its first token from with its own generator."""
    return (prompt_len - 1) // block_size, (prompt_len - 1) % block_size != 0


def fork_blocks(pool: BlockPool, parent: Sequence, child: Sequence, block_size: int,
                windows: WindowBlocks | None = None) -> list[BlockCopy] | None:
    """Gives `child` the parent's prompt KV: shared whole blocks (reference counted) that it already
    holds in `child.block_table` (and `child.window_table`), plus a copy of the partly filled block.
    Returns the block copies the KV cache must make, or None (nothing changed) if no block is free.
    """
    shared, partial = fork_layout(child.num_prompt_tokens, block_size)
    if len(child.block_table) != shared:  # the prefix was not all there: the child computes the rest
        return []
    copies = []
    if partial:
        if pool.num_free < 1 or (windows is not None and windows.pool.num_free < 1):
            return None
        block = pool.allocate(1)[0]
        copies.append(BlockCopy(parent.block_table[shared], block))
        child.block_table.append(block)
        if windows is not None:  # the partly filled block is the newest: inside every window
            block = windows.pool.allocate(1)[0]
            copies.append(BlockCopy(parent.window_table[shared], block, window=True))
            child.window_table.append(block)
    child.num_computed_tokens = child.num_prompt_tokens - 1
    return copies


class PagedKV:
    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, windows: WindowBlocks | None = None):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.windows = windows  # the sliding layers' pool, for models that have them
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
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        needed = total - len(seq.block_table)
        windows = self.windows
        if needed > self.pool.num_free or (windows is not None
                                           and windows.missing(seq, total) > windows.pool.num_free):
            return False
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        if windows is not None:
            windows.grow(seq, total)
        self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Shares the parent's computed prompt with `child` (n > 1): see `fork_blocks`."""
        shared, partial = fork_layout(child.num_prompt_tokens, self.block_size)
        if partial and (self.pool.num_free < 1 or (self.windows is not None and self.windows.pool.num_free < 1)):
            return None
        child.block_table = list(parent.block_table[:shared])
        for block in child.block_table:
            self.pool.retain(block)
        if self.windows is not None:
            child.window_table = self.windows.share(parent.window_table, shared)
        copies = fork_blocks(self.pool, parent, child, self.block_size, self.windows)
        self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used())
        return copies

    def on_computed(self, seq: Sequence) -> None:
        """Called after a step computed tokens of `seq`: window blocks it can no longer read go back."""
        if self.windows is not None:
            self.windows.trim(seq)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.pool.release(block)
        seq.block_table = []
        if self.windows is not None:
            self.windows.free(seq)

    def stats(self) -> dict[str, int]:
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_used": self.blocks_used(),
            "peak_blocks_used": self.peak_blocks_used,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            **(self.windows.stats() if self.windows is not None else {}),
        }
