"""Continuous batching with chunked prefill and recompute preemption.

Each step fills a token budget (step_budget.py: sized by measured step time, at most
max_num_batched_tokens): running sequences first, oldest first (decodes cost one token,
prefills in progress take a chunk), then waiting ones. When blocks run out the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed. The oldest sequence is always served first and, alone, always fits (requests that
could never fit are refused at admission), so the engine cannot deadlock.

Between tenants and priority bands, flow control (fair_share.py) decides: running sequences are
served band by band (oldest first within a band), admission follows the fair order, a victim for
blocks is taken from the least urgent band and the greediest tenant, and a waiting sequence whose
tenant is under its share of the slots (or whose band is more urgent) takes a slot from a tenant
over its share. With one tenant in one band, all of this is the plain order above.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from inferplane.worker.engine.fair_share import FairShare
from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.sequence import Sequence, SequenceStatus
from inferplane.worker.engine.step_budget import StepBudget

RECENT_TENANT_S = 300.0  # how long a tenant's queue figures stay reported (as 0) after its work ends


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    # Speculative decoding (speculation/speculator.py): tokens proposed after this decode row's
    # token, verified in the same forward as rows of their own; empty: none.
    draft: list[int] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """The forward's rows for this entry: its new tokens and its draft."""
        return self.num_new_tokens + len(self.draft)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    num_preempted: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, step_target_s: float = 0.0):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_budget = StepBudget(max_num_batched_tokens, step_target_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fair = FairShare(max_num_seqs)
        self.adapters = None  # lora.AdapterSlots where the engine serves adapters: admission takes a slot
        self._recent: dict[tuple[str, int], float] = {}  # (tenant, band) -> when last seen with work

    def add(self, seq: Sequence) -> None:
        self._recent[(seq.tenant, seq.band)] = time.monotonic()
        self.fair.activate(seq.tenant)
        self.waiting.append(seq)

    def _take_adapter_slot(self, seq: Sequence) -> bool:
        """Pins the slot of the sequence's adapter (loading it there if needed); False while every
        slot is pinned by other adapters' sequences: the sequence then waits, others go ahead."""
        if seq.adapter is None or seq.adapter_slot >= 0:
            return True
        slot = self.adapters.acquire(seq.adapter)
        if slot is None:
            return False
        self.adapters.pin(slot)
        seq.adapter_slot = slot
        return True

    def _release_adapter_slot(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.adapters.unpin(seq.adapter_slot)
            seq.adapter_slot = -1

    def _next_admissible(self) -> Sequence | None:
        """The first waiting sequence that can run now: its adapter (if any) has a slot."""
        for seq in self.waiting:
            if self._take_adapter_slot(seq):
                return seq
        return None

    def admit_forked(self, seq: Sequence) -> None:
        """A choice that already holds its prompt's KV (forked, n > 1) joins the running batch
        (its adapter is its leader's, whose slot is pinned)."""
        if not self._take_adapter_slot(seq):
            raise AssertionError(f"{seq.request_id}: its leader's adapter has no slot")
        self.fair.activate(seq.tenant)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def may_fork(self, seq: Sequence) -> bool:
        """Whether a forked choice may take a free slot now: yes unless another tenant (or a more
        urgent band) is waiting for one while this tenant already holds its share."""
        if len(self.running) >= self.max_num_seqs:
            return False
        others = [w for w in self.waiting if w.tenant != seq.tenant or w.band < seq.band]
        if not others:
            return True
        return sum(1 for r in self.running if r.tenant == seq.tenant) < self.fair.share()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        self._release_adapter_slot(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.step_budget.tokens_for(len(self.running))
        scheduled: list[ScheduledSequence] = []
        preempted = 0
        fair_preempted = self._preempt_for_waiting()
        queue = sorted(self.running, key=lambda s: s.band)  # most urgent band first, oldest first in it
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not self.kv.allocate(seq, n):
                victim = self.fair.block_victim([seq, *queue])
                if victim is not seq:
                    queue.remove(victim)
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
            if not fair_preempted:  # else the waiting queue already starts with those the slots were freed for
                self._order_waiting()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self._next_admissible()
                if seq is None:
                    break
                self.kv.match_prefix(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if not self.kv.allocate(seq, n):
                    self.kv.free(seq)
                    self._release_adapter_slot(seq)
                    seq.num_computed_tokens = 0
                    seq.num_cached_tokens = 0
                    break
                if seq is self.waiting[0]:
                    self.waiting.popleft()
                else:
                    self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        # Decode rows first: the model runner batches them into one attention call.
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return SchedulerOutput(scheduled, preempted + fair_preempted)

    def _order_waiting(self) -> None:
        """The fair order between tenants and bands; each runtime's own order within a tenant
        (paged: first come, first served; radix: see radix_scheduler.py, which calls this last)."""
        if len(self.waiting) > 1:
            self.waiting = deque(self.fair.admission_order(list(self.waiting), self.running))

    def _preempt_for_waiting(self) -> int:
        """When every slot is taken, frees slots for the waiting sequences entitled to one (a more
        urgent band, or a tenant under its share), taking them from the tenants over their share,
        and puts those sequences at the head of the queue so that admission gives them the slots
        (not the preempted ones back). None while nobody else waits."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return 0
        busy = {s.tenant for s in self.running} | {s.tenant for s in self.waiting}
        self.fair.deactivate_idle(busy)
        order = self.fair.admission_order(list(self.waiting), self.running)
        first: list[Sequence] = []
        granted: Counter[str] = Counter()
        refused: set[tuple[int, str]] = set()  # a refusal holds for the step: preempting others never undoes it
        for seq in order:
            if (seq.band, seq.tenant) in refused:
                continue
            if not self.fair.entitled(seq, self.running, granted[seq.tenant]):
                refused.add((seq.band, seq.tenant))
                continue
            victim = self.fair.victim(seq, self.running)
            if victim is None:
                refused.add((seq.band, seq.tenant))
                continue
            self.running.remove(victim)
            self._preempt(victim)
            self.fair.preemptions += 1
            first.append(seq)
            granted[seq.tenant] += 1
            if len(first) >= self.max_num_seqs // 2:  # never turn the whole batch over in one step
                break
        if first:
            chosen = set(first)
            self.waiting = deque(first + [s for s in self.waiting if s not in chosen])
        return len(first)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence wherever it is and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self._release_adapter_slot(seq)
        seq.status = SequenceStatus.FINISHED
        if not any(s.tenant == seq.tenant for s in self.running) and \
                not any(s.tenant == seq.tenant for s in self.waiting):
            self.fair.active.discard(seq.tenant)

    def tenant_queues(self) -> dict[tuple[str, str, int], int]:
        """(state, tenant, band) -> sequences: what the per-tenant queue metrics report. A tenant and
        band seen in the last RECENT_TENANT_S seconds reports 0 once its work is done, so its series
        falls to zero instead of vanishing (a scrape between requests still sees it)."""
        counts: dict[tuple[str, str, int], int] = {}
        now = time.monotonic()
        for state, seqs in (("running", self.running), ("waiting", self.waiting)):
            for seq in seqs:
                key = (state, seq.tenant, seq.band)
                counts[key] = counts.get(key, 0) + 1
                self._recent[(seq.tenant, seq.band)] = now
        for (tenant, band), seen in list(self._recent.items()):
            if now - seen > RECENT_TENANT_S:
                del self._recent[(tenant, band)]
                continue
            for state in ("running", "waiting"):
                counts.setdefault((state, tenant, band), 0)
        return counts
