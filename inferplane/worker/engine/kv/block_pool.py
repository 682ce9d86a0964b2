"""The block allocator: a fixed set of KV block ids with reference counts.

Reference counts exist for sharing: the radix runtime lets several sequences (and its prefix
tree) hold the same block, and a block returns to the free list only when the last holder lets go.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens' KV."""
    return (num_tokens + block_size - 1) // block_size


class OutOfBlocks(Exception):
    """Raised internally when an allocation cannot be met; the KV managers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.allocations = 0  # blocks handed out since start: what a shared (forked, cached) prefix saves

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        self.allocations += count
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def retain(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise AssertionError(f"retain of free block {block}")
        self.ref_counts[block] += 1

    def release(self, block: int) -> bool:
        """Drops one reference; returns True when the block went back to the free list."""
        count = self.ref_counts[block]
        if count <= 0:
            raise AssertionError(f"release of free block {block}")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free.append(block)
            return True
        return False
