"""Continuous batching with chunked prefill and recompute preemption.

Each step fills a token budget (step_budget.py: sized by measured step time, at most
max_num_batched_tokens): running sequences first, oldest first (decodes cost one token,
prefills in progress take a chunk), then waiting ones. When blocks run out the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed. The oldest sequence is always served first and, alone, always fits (requests that
could never fit are refused at admission), so the engine cannot deadlock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inferplane.worker.sequence import Sequence, SequenceStatus
from inferplane.worker.step_budget import StepBudget


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv, max_num_seqs: int, max_num_batched_tokens: int, step_target_s: float = 0.0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = StepBudget(max_num_batched_tokens, step_target_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit_forked(self, seq: Sequence) -> None:
        """A choice that already holds its prompt's KV (forked, n > 1) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _order_waiting(self) -> None:
        """Hook for the radix runtime's cache-aware ordering; paged serves first come, first served."""

    def schedule(self) -> SchedulerOutput:
        budget = self.step_budget.tokens_for(len(self.running))
        scheduled: list[ScheduledSequence] = []
        preempted = 0
        queue = list(self.running)  # oldest first
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.kv.allocate(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                continue
            kept.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        self.running = kept
        if not preempted:
            self._order_waiting()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                self.kv.match_prefix(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.kv.allocate(seq, n):
                    self.kv.free(seq)
                    seq.num_computed_tokens = 0
                    seq.num_cached_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        # Decode rows first: the model runner batches them into one attention call.
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled, preempted)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
