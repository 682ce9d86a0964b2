"""What a KV manager is: the accounting of which KV blocks each sequence holds, behind one interface.

The scheduler and the engine never touch a block pool themselves; they ask the sequence's manager
to match a cached prefix, to make room for the next tokens, to share a prompt with a fork, to hear
that tokens were computed, and to let a sequence go. `PagedKV` (kv/paged.py) keeps nothing after a
sequence ends; `RadixKV` (kv/radix.py) keeps finished blocks in a prefix tree and evicts them when
the pool runs short. Whatever a manager keeps or evicts (a later one may move blocks to slower
memory), these calls and their promises are all the rest of the engine relies on.

The manager owns block ids only; the KV tensors live in `ops.kv_cache.PagedKVCache`, indexed by
the ids a sequence's `block_table` (and, for sliding-window layers, `window_table`) lists. The one
tensor work a manager asks for is a `BlockCopy`, which the engine carries out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inferplane.worker.engine.kv.block_pool import BlockPool, blocks_for
from inferplane.worker.engine.kv.window import WindowBlocks
from inferplane.worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from inferplane.worker.engine.kv.events import KVEventLog
    from inferplane.worker.engine.kv.tiers.link import TierLink


@dataclass(frozen=True)
class BlockCopy:
    """One block's KV copied into another, in every layer of the main pool or of the window pool."""

    source: int
    destination: int
    window: bool = False


def fork_layout(prompt_len: int, block_size: int) -> tuple[int, bool]:
    """How a fork shares a computed prompt: (whole blocks before the last prompt token, which the
    child shares read-only; whether the block holding that token is partly filled, so the child
    needs its own copy of it). The child then recomputes only the last prompt token, whose logits
    it samples its first token from with its own generator."""
    return (prompt_len - 1) // block_size, (prompt_len - 1) % block_size != 0


class KVManager(ABC):
    """The blocks of one main pool (and of the sliding layers' window pool, for models that have
    them) and which sequence holds which.

    Promises every manager keeps, because the scheduler's preemption and the engine's step depend
    on them:
    - `allocate` and `fork` either do everything or change nothing a sequence holds (a manager may
      still drop cache it alone held to make room), so a refusal can be met by preempting someone.
    - `free` gives back everything a sequence holds, whatever state it is in (running, waiting
      after a failed admission, preempted, aborted); afterwards its tables are empty.
    - `blocks_used` counts blocks running sequences hold, each shared block once; blocks a manager
      keeps only as cache are reclaimable at any time and are not counted there.
    """

    name: str  # the runtime's name for this manager ("paged", "radix"), as in api.resolve.PRESETS
    tiers: TierLink | None = None  # where blocks go when they leave the pool (kv/tiers/); radix only, for now
    events: KVEventLog | None = None  # what the pool and tiers hold, published (kv/events.py); radix only

    def __init__(self, num_blocks: int, block_size: int, windows: WindowBlocks | None = None):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.windows = windows  # the sliding layers' pool, for models that have them
        self.peak_blocks_used = 0
        self.prefix_query_tokens = 0  # prompt tokens looked up in a prefix cache (0 without one)
        self.prefix_hit_tokens = 0  # of those, tokens found there

    @property
    def num_blocks(self) -> int:
        """The main pool's size: what add_request checks a request's whole length against."""
        return self.pool.num_blocks

    def blocks_used(self) -> int:
        return self.pool.num_used

    def _note_peak(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.blocks_used())

    # -- what each manager decides ----------------------------------------------------------------

    @abstractmethod
    def match_prefix(self, seq: Sequence) -> None:
        """Called once per admission, before `allocate`, on a sequence that holds no KV: gives it
        whatever prefix of its tokens the manager already has (blocks in its table, those tokens
        counted in `num_computed_tokens` and, for prompt tokens, `num_cached_tokens`), so that the
        step computes only the rest. A manager without a prefix cache leaves it at token 0."""

    @abstractmethod
    def _reserve(self, blocks: int, window_blocks: int) -> bool:
        """Makes `blocks` main-pool blocks and `window_blocks` window-pool blocks free (dropping
        cache the manager alone holds, if it keeps any); False where it cannot, with no sequence's
        blocks touched. The one place a manager decides where room comes from."""

    @abstractmethod
    def _share_prompt(self, parent: Sequence, child: Sequence, shared: int) -> None:
        """Gives `child` (holding nothing) the parent's first `shared` whole prompt blocks, each
        with a reference of its own, the window blocks too. A prefix cache may find them itself."""

    # -- the interface the scheduler and the engine use -------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes room for `num_new_tokens` more computed tokens of `seq` (its table then covers
        them); False, with nothing `seq` holds changed, where the pools are short."""
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        needed = total - len(seq.block_table)
        window_needed = self.windows.missing(seq, total) if self.windows is not None else 0
        if not self._reserve(needed, window_needed):
            return False
        if needed > 0:
            seq.block_table.extend(self.pool.allocate(needed))
        if self.windows is not None:
            self.windows.grow(seq, total)
        self._note_peak()
        return True

    def fork(self, parent: Sequence, child: Sequence) -> list[BlockCopy] | None:
        """Gives `child` (another choice of the parent's request, n > 1, holding nothing) the
        parent's computed prompt: whole blocks shared, the partly filled last one copied, so that
        the child recomputes only the last prompt token. Returns the copies the KV cache must make,
        or None (the child holds nothing) where no block is free for the copy."""
        shared, partial = fork_layout(child.num_prompt_tokens, self.block_size)
        if partial and not self._reserve(1, 1 if self.windows is not None else 0):
            return None
        self._share_prompt(parent, child, shared)
        copies = self._copy_partial_block(parent, child, shared, partial)
        if copies is None:  # cannot happen after the reserve above; undone for safety
            self.free(child)
            child.num_computed_tokens = child.num_cached_tokens = 0
        self._note_peak()
        return copies

    def _copy_partial_block(self, parent: Sequence, child: Sequence, shared: int,
                            partial: bool) -> list[BlockCopy] | None:
        """The child's own copy of the parent's partly filled prompt block (the newest, so inside
        every window too); None (nothing changed) if no block is free."""
        if len(child.block_table) != shared:  # the prefix was not all there: the child computes the rest
            return []
        copies = []
        windows = self.windows
        if partial:
            if self.pool.num_free < 1 or (windows is not None and windows.pool.num_free < 1):
                return None
            block = self.pool.allocate(1)[0]
            copies.append(BlockCopy(parent.block_table[shared], block))
            child.block_table.append(block)
            if windows is not None:
                block = windows.pool.allocate(1)[0]
                copies.append(BlockCopy(parent.window_table[shared], block, window=True))
                child.window_table.append(block)
        child.num_computed_tokens = child.num_prompt_tokens - 1
        return copies

    def on_computed(self, seq: Sequence) -> None:
        """Called after a step computed tokens of `seq` (each burst step too): window blocks no
        later query of it can read go back to the pool."""
        if self.windows is not None:
            self.windows.trim(seq)

    def free(self, seq: Sequence) -> None:
        """Lets go of every block `seq` holds (finished, aborted, preempted, or refused at admission)."""
        for block in seq.block_table:
            self.pool.release(block)
        seq.block_table = []
        if self.windows is not None:
            self.windows.free(seq)

    def stats(self) -> dict[str, int]:
        """The pool figures the worker exports (serve/metrics.py names them)."""
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_used": self.blocks_used(),
            "peak_blocks_used": self.peak_blocks_used,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "blocks_allocated_total": self.pool.allocations,  # what a shared (forked, cached) prefix saves
            **(self.windows.stats() if self.windows is not None else {}),
        }
