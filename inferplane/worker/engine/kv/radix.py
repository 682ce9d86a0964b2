"""The radix runtime's KV manager: the paged block pool plus a prefix tree of finished KV.

A sequence starts by borrowing the longest cached prefix of its tokens (reference-counted, locked
against eviction) and computes only the rest into fresh blocks of its own. Its full blocks join the
tree after each prefill chunk, so requests queued behind it can reuse them at once, and again when
it ends (finished, aborted or preempted), so the answer of turn N is cached for turn N+1. The tree
keeps those blocks after the sequence lets go; when the pool runs short, `allocate` evicts the least
recently used unlocked leaves.

Models with sliding-window layers keep those layers' KV in a second pool (kv/window.py). A sequence
frees the window blocks its window has passed after each step; the tree keeps its own reference on
those it was given, as cache, until the pool runs short (`RadixTree.evict_windows`). A cached prefix
is used only up to the last block boundary whose window is all still kept: sliding layers need the
window's keys, and they cannot be recomputed without recomputing the prefix.

Accounting, so that the runtimes compare on the same footing: `blocks_used` counts blocks some
running sequence references, each shared block once; `blocks_cached` counts blocks only the tree
holds, which are reclaimable at any time.
"""

from __future__ import annotations

from collections.abc import Callable

from inferplane.api.kv_blocks import chain_keys, kv_namespace
from inferplane.worker.engine.kv.events import KVEventLog
from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.kv.radix_tree import BlockKey, Node, RadixTree, block_keys
from inferplane.worker.engine.kv.tiers.link import TierLink
from inferplane.worker.engine.kv.window import NULL_BLOCK, WindowBlocks, first_kept_block
from inferplane.worker.engine.sequence import Sequence


class RadixKV(KVManager):
    name = "radix"

    def __init__(self, num_blocks: int, block_size: int, windows: WindowBlocks | None = None,
                 tiers: TierLink | None = None, events: KVEventLog | None = None):
        super().__init__(num_blocks, block_size, windows)
        # With `events`, the tree publishes each block it takes in or lets go (kv/events.py), and the
        # tiers theirs, so that gateways can route a conversation to where its blocks are.
        self.events = events
        self.tree = RadixTree(self.pool, windows.pool if windows is not None else None, events)
        # Below the tree, the tiers (kv/tiers/): every full block is saved as it joins the tree, and
        # a prefix the tree lacks is looked for there before it is computed again.
        self.tiers = tiers
        self._chains: dict[Sequence, list[bytes]] = {}  # each sequence's tier keys, as far as computed
        # First-admission lookups, counted only once the admission succeeds: a sequence may be
        # matched several times before it gets in, and a preempted one must not count again.
        self._pending_query: dict[Sequence, tuple[int, int]] = {}

    def namespace(self, seq: Sequence) -> str:
        """A request's prefixes are matched only among requests with the same cache salt.

        The salt is decided once, by the gateway (per tenant, or one for everybody where every
        deployment behind the served name allows sharing): tenants sharing blocks could learn each
        other's prompts from hit timing, so the worker never widens what the salt allows. Under a
        LoRA adapter the same tokens give other KV, so the adapter (name and version) is part of it.
        """
        return kv_namespace(seq.cache_salt, seq.adapter_key)

    def blocks_used(self) -> int:
        return self.pool.num_used - self.tree.evictable_blocks

    def blocks_cached(self) -> int:
        return self.tree.evictable_blocks

    def _matchable_keys(self, seq: Sequence) -> list[BlockKey]:
        """Full blocks strictly before the last token: one token is always left to compute, since
        sampling needs its logits. None for a sequence that wants its prompt's logprobs: they
        need every prompt position's logits."""
        if seq.wants_prompt_logprobs:
            return []
        tokens = seq.all_token_ids
        return block_keys(tokens, self.block_size, (len(tokens) - 1) // self.block_size)

    def peek_match(self, seq: Sequence) -> int:
        """Tokens `match_prefix` would find now, without locking or touching anything."""
        return self.tree.peek(self.namespace(seq), self._matchable_keys(seq)) * self.block_size

    # -- the KV-manager interface -----------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise AssertionError(f"{seq.request_id}: match_prefix on a sequence that holds KV")
        keys = self._matchable_keys(seq)
        if self.tiers is not None and keys:
            self._load_from_tiers(seq, keys)
        node, blocks, windows = self.tree.match(self.namespace(seq), keys)
        if self.windows is not None:
            usable = self._window_usable(windows)
            if usable < len(blocks):  # match again, to end (split) exactly where the windows allow
                node, blocks, windows = self.tree.match(self.namespace(seq), keys[:usable])
            first = first_kept_block(len(blocks) * self.block_size, self.windows.window, self.block_size)
            seq.window_table = [NULL_BLOCK] * first + self.windows.share(windows[first:], len(blocks) - first)
        for block in blocks:
            self.pool.retain(block)
        self._relock(seq, node)
        seq.block_table = list(blocks)
        matched = len(blocks) * self.block_size
        seq.num_computed_tokens = matched
        seq.num_cached_tokens = min(matched, seq.num_prompt_tokens)
        if seq.num_preemptions == 0:
            self._pending_query[seq] = (seq.num_prompt_tokens, seq.num_cached_tokens)
        self._note_peak()

    def _window_usable(self, windows: list[int]) -> int:
        """The deepest block count d <= len(windows) whose window (blocks from first_kept_block(d)
        to d) the tree keeps entirely; 0 always qualifies."""
        return self._window_depth(0, len(windows), lambda p: windows[p] != NULL_BLOCK) or 0

    def _window_depth(self, low: int, high: int, have: Callable[[int], bool]) -> int | None:
        """The deepest block count d in [low, high] whose last window's positions (first_kept_block(d)
        up to d) all pass `have`; None where none does. The one scan behind every rule that a prefix
        is usable only as deep as its last window's blocks are there."""
        bs, window = self.block_size, self.windows.window
        for depth in range(high, low - 1, -1):
            if all(have(p) for p in range(first_kept_block(depth * bs, window, bs), depth)):
                return depth
        return None

    def _reserve(self, blocks: int, window_blocks: int) -> bool:
        """Evicts the least recently used cache for what the pools lack; evicts nothing for a
        main-pool shortfall the cache cannot cover (the allocation would fail anyway)."""
        short = blocks - self.pool.num_free
        if short > 0:
            if short > self.tree.evictable_blocks:
                return False
            self.tree.evict(short)
        if self.windows is None:
            return True
        short = window_blocks - self.windows.pool.num_free
        if short <= 0:
            return True
        if short > self.tree.evictable_windows():
            return False
        self.tree.evict_windows(short)
        return True

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """As every manager's; a first admission's prefix lookup counts once it got in."""
        if not super().allocate(seq, num_new_tokens):
            return False
        query = self._pending_query.pop(seq, None)
        if query is not None:
            self.prefix_query_tokens += query[0]
            self.prefix_hit_tokens += query[1]
        return True

    def _share_prompt(self, parent: Sequence, child: Sequence, shared: int) -> None:
        """The parent's whole prompt blocks are in the tree already (`on_computed`), so the child
        borrows them as any prefix hit does."""
        self.match_prefix(child)

    def on_computed(self, seq: Sequence) -> None:
        """Publishes prompt blocks as soon as they are computed, so that followers waiting on this
        prefix start early; decode blocks wait until the sequence ends."""
        if seq.num_computed_tokens <= seq.num_prompt_tokens:
            self._insert(seq)
        super().on_computed(seq)  # after the insert: the tree keeps what the sequence lets go

    def free(self, seq: Sequence) -> None:
        """Its computed blocks join the tree first, so the tree keeps them as cache."""
        self._pending_query.pop(seq, None)
        if seq.block_table:
            self._insert(seq)
        self._chains.pop(seq, None)
        self._relock(seq, None)
        super().free(seq)

    def stats(self) -> dict[str, int]:
        stats = super().stats()
        stats.update(blocks_cached=self.blocks_cached(), evicted_blocks=self.tree.evicted_blocks,
                     tree_nodes=self.tree.num_nodes)
        if self.tiers is not None:
            stats.update(self.tiers.stats())
        if self.windows is not None:
            stats["window_evicted_blocks"] = self.tree.evicted_window_blocks
        if self.events is not None:
            stats["kv_events_published_total"] = self.events.published
        return stats

    # -- internals --------------------------------------------------------------------------------

    def _deepest(self, seq: Sequence) -> Node | None:
        return seq.locked_nodes[0] if seq.locked_nodes else None

    def _relock(self, seq: Sequence, node: Node | None) -> None:
        """Moves the sequence's lock to `node`'s path (lock first, so shared ancestors never pass
        through unlocked). `seq.locked_nodes` holds just the deepest node: its path is locked."""
        old = self._deepest(seq)
        if node is not None and not node.is_root:
            self.tree.lock(node)
            seq.locked_nodes = [node]
        else:
            seq.locked_nodes = []
        self.tree.unlock(old)

    def _insert(self, seq: Sequence) -> None:
        """Adds the sequence's full computed blocks to the tree. Where the tree already had a block
        for the same tokens (two sequences computed one prefix), the sequence switches to the
        tree's copy and frees its own, so the prefix is held once."""
        full = seq.num_computed_tokens // self.block_size
        start = self._deepest(seq)
        depth = start.depth if start is not None else 0
        if full <= depth:
            return
        keys = block_keys(seq.all_token_ids, self.block_size, full)
        windows = seq.window_table[:full] if self.windows is not None else None
        chain = self._chain(seq, full) if self.tiers is not None or self.events is not None else None
        node, held, held_windows = self.tree.insert(self.namespace(seq), start, keys, seq.block_table[:full], windows,
                                                    chain)
        if self.tiers is not None:
            for i in range(depth, full):
                window = held_windows[i - depth] if self.windows is not None else NULL_BLOCK
                self.tiers.save(chain[i], held[i - depth], window if window != NULL_BLOCK else None)
        for i, block in enumerate(held, start=depth):
            own = seq.block_table[i]
            if own != block:
                self.pool.retain(block)
                self.pool.release(own)
                seq.block_table[i] = block
        if self.windows is not None:
            for i, block in enumerate(held_windows, start=depth):
                own = seq.window_table[i]
                if own != NULL_BLOCK and own != block:  # never take back a block the window has passed
                    self.windows.pool.retain(block)
                    self.windows.pool.release(own)
                    seq.window_table[i] = block
        self._relock(seq, node)

    # -- tiers ------------------------------------------------------------------------------------

    def _chain(self, seq: Sequence, count: int) -> list[bytes]:
        """The tier keys of the sequence's first `count` full blocks, extended as it computes."""
        chain = self._chains.setdefault(seq, [])
        if len(chain) < count:
            tokens = seq.all_token_ids[len(chain) * self.block_size:count * self.block_size]
            chain.extend(chain_keys(self.namespace(seq), tokens, self.block_size, chain[-1] if chain else None))
        return chain[:count]

    def _load_from_tiers(self, seq: Sequence, keys: list[BlockKey]) -> None:
        """Reads into the tree the blocks after its cached prefix of `keys` that the tiers hold (in a
        row, as far as free and evictable blocks allow), so that the match that follows finds them.
        With sliding-window layers a prefix is read only as deep as its last window's blocks can be
        had too (from the tree or the tiers), as a match uses it; window blocks the tree dropped
        from a prefix it still holds are read back as well. The path already matched is locked
        meanwhile, and the window blocks it needs held, so making room never evicts them."""
        namespace = self.namespace(seq)
        node, blocks, windows = self.tree.match(namespace, keys)
        start = len(blocks)
        restore = self.windows is not None and start > 0 and self._window_usable(windows) < start
        if start == len(keys) and not restore:
            return  # the tree holds the whole prefix
        chain = self._chain(seq, len(keys))
        run = self.tiers.held_run(chain, start)
        if run == 0 and not restore:
            return
        self.tree.lock(node)
        try:
            run = min(run, self.pool.num_free + self.tree.evictable_blocks)
            depth, window_positions = self._tier_depth(chain, windows, start, start + run, restore)
            if depth < start or (depth == start and not window_positions):
                return
            if not self._reserve_keeping(depth - start, window_positions, windows, depth, start):
                return
            self._read_blocks(namespace, keys, chain, blocks, windows, start, depth, window_positions)
        finally:
            self.tree.unlock(node)

    def _reserve_keeping(self, blocks: int, window_positions: list[int], windows: list[int], depth: int,
                         start: int) -> bool:
        """`_reserve` for a read of `blocks` main blocks and the window parts at `window_positions`,
        holding meanwhile the window blocks the tree keeps for the rest of the last window (which
        `evict_windows` could otherwise take even on a locked path)."""
        kept = []
        if self.windows is not None:
            bs, window = self.block_size, self.windows.window
            kept = [windows[p] for p in range(first_kept_block(depth * bs, window, bs), min(depth, start))
                    if windows[p] != NULL_BLOCK]
            for block in kept:
                self.windows.pool.retain(block)
        try:
            return (self._reserve(blocks, len(window_positions)) and self.pool.num_free >= blocks
                    and (self.windows is None or self.windows.pool.num_free >= len(window_positions)))
        finally:
            for block in kept:
                self.windows.pool.release(block)

    def _read_blocks(self, namespace: str, keys: list[BlockKey], chain: list[bytes], blocks: list[int],
                     windows: list[int], start: int, depth: int, window_positions: list[int]) -> None:
        """Reads main blocks start..depth and the window parts at `window_positions` into fresh pool
        blocks and gives the tree what was read intact (a part that fails its checks cuts the prefix
        there); the rest goes back to the pools, whatever happens."""
        fresh = self.pool.allocate(depth - start)
        fresh_windows = self.windows.pool.allocate(len(window_positions)) if window_positions else []
        try:
            loaded = 0
            for key, block in zip(chain[start:depth], fresh, strict=True):
                if not self.tiers.load(key, block):
                    break
                loaded += 1
            end = start + loaded
            table, got = None, {}
            if self.windows is not None:
                got = {p: b for p, b in zip(window_positions, fresh_windows, strict=True)
                       if p < end and self.tiers.load(chain[p], b, window=True)}
                end = self._deepest_with_windows(windows, got, start, end)
                # Only what was just read: the tree keeps its own window blocks, and an id `windows`
                # still names may have been freed while room was made.
                table = [NULL_BLOCK] * end
                for position, block in got.items():
                    if position < end:
                        table[position] = block
            if end > start or got:
                self.tree.insert(namespace, None, keys[:end], [*blocks, *fresh[:end - start]], table, chain[:end])
        finally:
            for block in fresh:  # the tree holds what it adopted
                self.pool.release(block)
            for block in fresh_windows:
                self.windows.pool.release(block)

    def _tier_depth(self, chain: list[bytes], windows: list[int], start: int, end: int,
                    restore: bool = False) -> tuple[int, list[int]]:
        """The deepest block count d in (start, end] (or [start, end] with `restore`: window blocks
        the tree dropped from its own prefix) whose last window's blocks the tree or the tiers hold,
        and the positions whose window parts must come from the tiers for it; (start - 1, []) where
        none qualifies. Without sliding layers: (end, [])."""
        if self.windows is None:
            return end, []

        def from_tiers(p: int) -> bool:
            return p >= start or windows[p] == NULL_BLOCK

        depth = self._window_depth(start if restore else start + 1, end,
                                   lambda p: not from_tiers(p) or self.tiers.holds_window(chain[p]))
        if depth is None:
            return start - 1, []
        bs, window = self.block_size, self.windows.window
        return depth, [p for p in range(first_kept_block(depth * bs, window, bs), depth) if from_tiers(p)]

    def _deepest_with_windows(self, windows: list[int], got: dict[int, int], start: int, end: int) -> int:
        """The deepest block count in (start, end] whose last window's blocks are all there (kept by
        the tree, or just read from the tiers: `got`); `start` where none is."""
        depth = self._window_depth(start + 1, end, lambda p: p in got or (p < start and windows[p] != NULL_BLOCK))
        return start if depth is None else depth
