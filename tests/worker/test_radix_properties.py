"""Property test: random interleavings of arrivals, prefill chunks, decodes, finishes, aborts,
preemptions and evictions keep RadixKV's invariants.

The KV itself is simulated: each pool slot remembers the token last written into it. A sequence
may read its block table only where the slot holds its own token at that position, and may write
only into blocks nobody else holds, so a wrong match, a lost lock or an eviction of a block in use
shows up as wrong contents, whatever the bookkeeping says.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferplane.worker.engine.kv.radix import RadixKV
from inferplane.worker.engine.kv.window import NULL_BLOCK, WindowBlocks, first_kept_block
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence

BLOCK = 2
NUM_BLOCKS = 14
# Prompts drawn from a few stems, so that prefixes are shared at every alignment.
STEMS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [4, 4, 4, 4, 4, 4], [1, 2]]


def _seq(name: str, tokens: list[int], salt: str) -> Sequence:
    return Sequence(request_id=name, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=64,
                    rng_key=0, cache_salt=salt)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = RadixKV(NUM_BLOCKS, BLOCK)
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.count = 0

    # -- what the engine does ---------------------------------------------------------------------

    def _compute(self, seq: Sequence, n: int) -> None:
        """Writes the KV of n more tokens, as the model runner would."""
        tree_blocks = {b for node in self.kv.tree.nodes() for b in node.blocks}
        tokens = seq.all_token_ids
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // BLOCK]
            assert self.kv.pool.ref_counts[block] == 1, "wrote into a shared block"
            assert block not in tree_blocks, "wrote into a cached block"
            self.slots[(block, pos % BLOCK)] = tokens[pos]
        seq.num_computed_tokens += n
        self.kv.on_computed(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.waiting.insert(0, seq)

    # -- rules ------------------------------------------------------------------------------------

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 9), max_size=4),
          salt=st.sampled_from("ab"))
    def arrive(self, stem, tail, salt):
        self.count += 1
        self.waiting.append(_seq(f"r{self.count}", stem + tail, salt))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8))
    def admit(self, pick, chunk):
        seq = self.waiting[pick % len(self.waiting)]
        self.kv.match_prefix(seq)
        assert seq.num_computed_tokens % BLOCK == 0
        assert seq.num_computed_tokens < seq.num_tokens, "a match must leave a token to compute"
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if not self.kv.allocate(seq, n):
            self.kv.free(seq)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return
        self.waiting.remove(seq)
        self.running.append(seq)
        self._compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8), token=st.integers(0, 9))
    def step(self, pick, chunk, token):
        seq = self.running[pick % len(self.running)]
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(token)  # sampled: the next step decodes it
            return
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if not self.kv.allocate(seq, n):
            self._preempt(seq)
            return
        self._compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def finish_or_abort(self, pick):
        seq = self.running.pop(pick % len(self.running))
        self.kv.free(seq)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def preempt(self, pick):
        self._preempt(self.running[pick % len(self.running)])

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99))
    def abort_waiting(self, pick):
        seq = self.waiting.pop(pick % len(self.waiting))
        self.kv.free(seq)

    @rule(count=st.integers(1, NUM_BLOCKS))
    def evict(self, count):
        before = self.kv.pool.num_free
        freed = self.kv.tree.evict(count)
        assert self.kv.pool.num_free == before + freed

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def every_block_free_used_or_cached(self):
        pool, tree = self.kv.pool, self.kv.tree
        nodes = list(tree.nodes())
        tree_blocks = [b for n in nodes for b in n.blocks]
        assert len(tree_blocks) == len(set(tree_blocks)) == tree.num_blocks, "a block is cached twice"
        expected = [0] * NUM_BLOCKS
        for b in tree_blocks:
            expected[b] += 1
        for seq in self.running:
            for b in seq.block_table:
                expected[b] += 1
        assert min(pool.ref_counts) >= 0
        assert pool.ref_counts == expected, "reference counts do not match the holders"
        free = list(pool._free)
        assert len(free) == len(set(free))
        assert set(free) == {b for b in range(NUM_BLOCKS) if expected[b] == 0}, "a block was lost"
        for seq in self.waiting:
            assert not seq.block_table and not seq.locked_nodes

    @invariant()
    def locks_cover_running_paths(self):
        tree = self.kv.tree
        nodes = list(tree.nodes())
        locks = {id(n): 0 for n in nodes}
        for seq in self.running:
            node = seq.locked_nodes[0] if seq.locked_nodes else None
            path_blocks = []
            while node is not None and not node.is_root:
                locks[id(node)] += 1  # KeyError here: a locked node was evicted
                path_blocks = node.blocks + path_blocks
                node = node.parent
            assert seq.block_table[: len(path_blocks)] == path_blocks
        for n in nodes:
            assert n.lock_ref == locks[id(n)] >= 0
            if n.lock_ref == 0:
                assert all(self.kv.pool.ref_counts[b] == 1 for b in n.blocks)
        unlocked = sum(len(n.blocks) for n in nodes if n.lock_ref == 0)
        assert tree.evictable_blocks == unlocked == self.kv.stats()["blocks_cached"]
        assert tree.num_nodes == len(nodes)
        assert self.kv.blocks_used() == len({b for s in self.running for b in s.block_table})

    @invariant()
    def kv_contents_are_valid(self):
        for seq in self.running:
            tokens = seq.all_token_ids
            for pos in range(seq.num_computed_tokens):
                assert self.slots.get((seq.block_table[pos // BLOCK], pos % BLOCK)) == tokens[pos]
        for node in self.kv.tree.nodes():
            for key, block in zip(node.keys, node.blocks, strict=True):
                assert tuple(self.slots.get((block, i)) for i in range(BLOCK)) == key

    @invariant()
    def salts_never_share(self):
        for ns, root in self.kv.tree.roots.items():
            for seq in self.running:
                if seq.locked_nodes and self.kv.namespace(seq) != ns:
                    node = seq.locked_nodes[0]
                    while node.parent is not None:
                        node = node.parent
                    assert node is not root


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixInvariants = RadixMachine.TestCase


WINDOW = 3
NUM_WINDOW_BLOCKS = 9  # the null block and 8 more: fewer than the main pool, so window blocks run short first


class WindowedRadixMachine(RadixMachine):
    """The same rules on a model with sliding-window layers (kv/window.py): a second pool of which
    each sequence keeps only the blocks its window reaches, cached by the tree beside the main
    blocks. A sequence must find its own tokens in the window slots it may read, and a prefix
    hit must bring the window with it."""

    def __init__(self):
        super().__init__()
        self.kv = RadixKV(NUM_BLOCKS, BLOCK, WindowBlocks(NUM_WINDOW_BLOCKS, BLOCK, WINDOW))
        self.window_slots: dict[tuple[int, int], int] = {}

    def _compute(self, seq: Sequence, n: int) -> None:
        tree_windows = {b for node in self.kv.tree.nodes() for b in node.windows if b != NULL_BLOCK}
        tokens = seq.all_token_ids
        start = seq.num_computed_tokens
        for pos in range(max(0, start - WINDOW + 1), start):  # a query at `start` reads keys after start - WINDOW
            assert self.window_slots.get((seq.window_table[pos // BLOCK], pos % BLOCK)) == tokens[pos]
        for pos in range(start, start + n):
            block = seq.window_table[pos // BLOCK]
            assert block != NULL_BLOCK and self.kv.windows.pool.ref_counts[block] == 1, "wrote a shared window block"
            assert block not in tree_windows, "wrote into a cached window block"
            self.window_slots[(block, pos % BLOCK)] = tokens[pos]
        super()._compute(seq, n)

    @rule(count=st.integers(1, NUM_WINDOW_BLOCKS))
    def evict_windows(self, count):
        before = self.kv.windows.pool.num_free
        freed = self.kv.tree.evict_windows(count)
        assert self.kv.windows.pool.num_free == before + freed

    @invariant()
    def window_blocks_are_held_by_their_holders_only(self):
        pool = self.kv.windows.pool
        expected = [0] * NUM_WINDOW_BLOCKS
        expected[NULL_BLOCK] = 1  # never handed out
        for node in self.kv.tree.nodes():
            for b in node.windows:
                expected[b] += b != NULL_BLOCK
        for seq in self.running:
            first = first_kept_block(seq.num_computed_tokens, WINDOW, BLOCK)
            assert all(b == NULL_BLOCK for b in seq.window_table[:first]), "kept a block the window passed"
            assert len(seq.window_table) == len(seq.block_table)
            for b in seq.window_table:
                expected[b] += b != NULL_BLOCK
        assert pool.ref_counts == expected
        assert set(pool._free) == {b for b in range(NUM_WINDOW_BLOCKS) if expected[b] == 0}
        for seq in self.waiting:
            assert not seq.window_table

    @invariant()
    def cached_window_blocks_hold_their_tokens(self):
        for node in self.kv.tree.nodes():
            for key, block in zip(node.keys, node.windows, strict=True):
                if block != NULL_BLOCK:
                    assert tuple(self.window_slots.get((block, i)) for i in range(BLOCK)) == key


WindowedRadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedRadixInvariants = WindowedRadixMachine.TestCase
