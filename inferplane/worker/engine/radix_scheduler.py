"""Cache-aware admission order for the radix runtime.

Three rules, applied to the waiting queue before each admission round:

1. Longest prefix match first: a request whose prefix is cached costs little to admit and keeps
   its cached blocks hot; serving it first raises the hit rate when the cache is short.
2. Aging: a request's priority grows with the steps it has waited (`aging_tokens_per_step` tokens
   of match per step), so a request with no match is admitted, at the latest, once it has waited
   for `max_model_len / aging_tokens_per_step` steps, whatever keeps arriving.
3. Hold-back: a request whose next uncached block some earlier request (running, or ahead of it
   in this round) is about to compute waits until that block is in the tree, so requests that
   arrive together with a shared prefix compute it once, not once each.

When the queue is longer than `fcfs_threshold`, the matching costs more than it saves and the
queue is served first come, first served (SGLang does the same).

Waiting time is counted in scheduler steps, the engine's own clock: the order does not depend
on how fast the device is, and tests can reason about it exactly.
"""

from __future__ import annotations

from collections import deque

from inferplane.worker.engine.kv.radix import RadixKV
from inferplane.worker.engine.scheduler import Scheduler, SchedulerOutput
from inferplane.worker.engine.sequence import Sequence, SequenceStatus


class RadixScheduler(Scheduler):
    """The scheduler with the cache-aware order above; its KV manager is a RadixKV, whose tree it peeks."""

    def __init__(self, kv: RadixKV, max_num_seqs: int, max_num_batched_tokens: int, step_target_s: float = 0.0, *,
                 fcfs_threshold: int = 128, aging_tokens_per_step: float = 16.0):
        super().__init__(kv, max_num_seqs, max_num_batched_tokens, step_target_s)
        self.fcfs_threshold = fcfs_threshold
        self.aging_tokens_per_step = aging_tokens_per_step
        self.num_held_back = 0  # admission rounds in which a request waited for a shared prefix
        self._step = 0
        self._arrival_step: dict[Sequence, int] = {}
        self._chain: dict[Sequence, list[int]] = {}  # per sequence: hash of each block prefix
        self._order: list[Sequence] | None = None

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self._arrival_step[seq] = self._step

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._arrival_step.pop(seq, None)
        self._chain.pop(seq, None)

    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._order = None
        try:
            return super().schedule()
        finally:
            if self._order is not None:
                # Put the held-back requests back, in priority order, behind nothing they were not
                # behind already (the admission round only pops from the front).
                self.waiting = deque(s for s in self._order if s.status is SequenceStatus.WAITING)
                self._order = None

    def priority(self, seq: Sequence, matched_tokens: int) -> float:
        waited = self._step - self._arrival_step.get(seq, self._step)
        return matched_tokens + self.aging_tokens_per_step * waited

    def _order_waiting(self) -> None:
        if not self.waiting or len(self.waiting) > self.fcfs_threshold:
            super()._order_waiting()
            return
        bs = self.kv.block_size
        matched = {seq: self.kv.peek_match(seq) for seq in self.waiting}
        # sorted() is stable: equal priorities keep queue order (preempted first, then arrival).
        order = sorted(self.waiting, key=lambda s: self.priority(s, matched[s]), reverse=True)
        claimed: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._claim(seq, seq.num_computed_tokens // bs, claimed)
        admissible = []
        for seq in order:
            first = matched[seq] // bs  # the first block the tree does not have
            if first < (seq.num_tokens - 1) // bs and self._block_hash(seq, first) in claimed:
                self.num_held_back += 1
                continue
            self._claim(seq, first, claimed)
            admissible.append(seq)
        # Between tenants and bands the fair order decides; this order holds within each.
        self.waiting = deque(self.fair.admission_order(admissible, self.running))
        self._order = order

    def _claim(self, seq: Sequence, first_block: int, claimed: set[int]) -> None:
        """Marks the prompt blocks `seq` will compute (and publish) from `first_block` on."""
        for i in range(first_block, seq.num_prompt_tokens // self.kv.block_size):
            claimed.add(self._block_hash(seq, i))

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """A hash of the sequence's namespace and tokens up to the end of block `index`: equal for
        two sequences exactly when (barring collisions, which only delay a request by a step) they
        could share that block."""
        chain = self._chain.setdefault(seq, [])
        if len(chain) <= index:
            bs = self.kv.block_size
            tokens = seq.all_token_ids
            prev = chain[-1] if chain else hash(("radix", self.kv.namespace(seq)))
            for i in range(len(chain), index + 1):
                prev = hash((prev, tuple(tokens[i * bs:(i + 1) * bs])))
                chain.append(prev)
        return chain[index]
