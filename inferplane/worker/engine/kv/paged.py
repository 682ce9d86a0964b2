"""PagedKV: every sequence owns its blocks outright; nothing is shared or kept after it ends.

Models with sliding-window layers keep those layers' KV in a second pool (kv/window.py): each
sequence holds there only the blocks its window still reaches, and frees the rest after every step.
"""

from __future__ import annotations

from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.sequence import Sequence


class PagedKV(KVManager):
    name = "paged"

    def match_prefix(self, seq: Sequence) -> None:
        """Paged keeps no prefix cache: a new sequence starts from token 0."""

    def _reserve(self, blocks: int, window_blocks: int) -> bool:
        """Paged keeps no cache to drop: the pools have the room or they do not."""
        return blocks <= self.pool.num_free and (self.windows is None or window_blocks <= self.windows.pool.num_free)

    def _share_prompt(self, parent: Sequence, child: Sequence, shared: int) -> None:
        child.block_table = list(parent.block_table[:shared])
        for block in child.block_table:
            self.pool.retain(block)
        if self.windows is not None:
            child.window_table = self.windows.share(parent.window_table, shared)
