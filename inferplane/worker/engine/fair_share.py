"""Flow control on one replica: priority bands, then a fair share of the work between tenants.

The policy is the virtual token counter of VTC (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), measured on the tokens the replica actually computes:

- Each tenant has a counter of the weighted tokens computed for it: a prompt token costs
  `PROMPT_WEIGHT`, an output token `OUTPUT_WEIGHT` (a decode step costs more per token than a
  prefill chunk). Tokens served from the prefix cache cost nothing: no work was done.
- Admission takes the most urgent band first (api/priority.py) and, within it, the tenant with the
  lowest counter, so a backlogged tenant cannot starve a light one.
- A tenant that comes back after being idle has its counter lifted to the lowest counter of the
  tenants that are active, so idleness banks no credit; and because only active tenants are
  compared, an idle tenant's share goes to the others (work-conserving).
- A tenant's share of the sequence slots is `max_num_seqs // active tenants`. A request's fan-out
  (n choices, several prompts) is that many sequences of its tenant; it may use every slot while
  nobody else waits, and gives back what is over its share (by preemption, newest first) as soon
  as a tenant under its share, or a more urgent band, is waiting for a slot.

Invariants the scheduler relies on:
- `admission_order` is a permutation of the waiting sequences; within one (band, tenant) it keeps
  their given order, so the runtime's own ordering (first come first served, or the radix
  runtime's cache-aware order) still decides among one tenant's requests.
- `victim` never chooses a sequence more urgent than, or of a tenant not over its share relative
  to, the one it makes room for; so preemption for fairness cannot cycle between two tenants.
- With one tenant and one band every function here returns what plain FCFS would: the policy
  costs nothing to a single-tenant replica.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
_MAX_IDLE_COUNTERS = 10_000  # counters kept for idle tenants before the lowest are forgotten


class FairShare:
    """The counters and the rules; it holds no sequences (the scheduler does), only figures about
    them, so it can be tested on plain objects with `tenant`, `band` and token counts."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.counters: dict[str, float] = {}
        self.active: set[str] = set()
        self.preemptions = 0  # sequences preempted to give a tenant its share or a band its precedence

    # -- counters ---------------------------------------------------------------------------------

    def activate(self, tenant: str) -> None:
        """A tenant with no queued or running sequence submits one: lift its counter to the lowest
        active counter (VTC's rule), so time spent idle is not credit."""
        if tenant in self.active:
            return
        floor = min((self.counters.get(t, 0.0) for t in self.active), default=None)
        own = self.counters.get(tenant, 0.0)
        self.counters[tenant] = own if floor is None else max(own, floor)
        self.active.add(tenant)

    def deactivate_idle(self, busy: Iterable[str]) -> None:
        """Tenants no longer holding any sequence stop counting as active."""
        self.active.intersection_update(busy)
        if len(self.counters) > _MAX_IDLE_COUNTERS:
            idle = sorted((c, t) for t, c in self.counters.items() if t not in self.active)
            for _, tenant in idle[: len(self.counters) - _MAX_IDLE_COUNTERS]:
                del self.counters[tenant]

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self.counters[tenant] = (self.counters.get(tenant, 0.0)
                                 + PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens)

    # -- shares -----------------------------------------------------------------------------------

    def share(self) -> int:
        """Sequence slots each active tenant is entitled to (at least one)."""
        return max(1, self.max_num_seqs // max(1, len(self.active)))

    # -- ordering ---------------------------------------------------------------------------------

    def admission_order(self, waiting: list, running: list = ()) -> list:
        """The waiting sequences in the order admission should take them: band by band, the tenant
        with the lowest counter first (on a tie, the one holding fewer running slots), charging
        each taken sequence's uncomputed tokens to a copy of the counters as it goes (so one round
        interleaves tenants instead of emptying the cheapest one's queue)."""
        if len(waiting) < 2:
            return list(waiting)
        queues: dict[tuple[int, str], list] = defaultdict(list)
        for seq in waiting:
            queues[(seq.band, seq.tenant)].append(seq)
        if len(queues) == 1:
            return list(waiting)
        counters = {tenant: self.counters.get(tenant, 0.0) for _, tenant in queues}
        held = Counter(r.tenant for r in running)
        heads = dict.fromkeys(queues, 0)
        order = []
        while heads:
            band, tenant = min(heads, key=lambda k: (k[0], counters[k[1]], held[k[1]]))
            key = (band, tenant)
            seq = queues[key][heads[key]]
            order.append(seq)
            counters[tenant] += PROMPT_WEIGHT * max(1, seq.num_tokens - seq.num_computed_tokens)
            heads[key] += 1
            if heads[key] == len(queues[key]):
                del heads[key]
        return order

    # -- preemption -------------------------------------------------------------------------------

    def entitled(self, seq, running: list, granted: int = 0) -> bool:
        """May `seq` (waiting) take a slot from a running sequence? Yes when some running sequence
        is of a less urgent band, or when its tenant holds fewer slots than its share (counting
        `granted`: slots already freed for it this step)."""
        if any(r.band > seq.band for r in running):
            return True
        held = sum(1 for r in running if r.tenant == seq.tenant)
        return held + granted < self.share()

    def victim(self, seq, running: list):
        """The running sequence to preempt so that `seq` gets a slot, or None: from the least
        urgent band first; within a band, only from a tenant over its share (the one holding the
        most slots), its newest sequence (the least work lost)."""
        worst_band = max(r.band for r in running)
        if worst_band > seq.band:
            pool = [r for r in running if r.band == worst_band]
        else:
            held = Counter(r.tenant for r in running if r.band == seq.band)
            share = self.share()
            if held[seq.tenant] >= share:
                return None
            over = {t: n for t, n in held.items() if n > share and t != seq.tenant}
            if not over:
                return None
            greediest = max(over, key=lambda t: (over[t], self.counters.get(t, 0.0)))
            pool = [r for r in running if r.band == seq.band and r.tenant == greediest]
        return pool[-1] if pool else None

    def block_victim(self, candidates: list):
        """The sequence to preempt when KV blocks run out (`candidates`: the one asking, then the
        running sequences not yet given their tokens this step, in running order; last is newest):
        the least urgent band, then the tenant holding the most of them, then the newest. With one
        tenant and one band: the newest, as before."""
        worst_band = max(c.band for c in candidates)
        pool = [c for c in candidates if c.band == worst_band]
        held = Counter(c.tenant for c in pool)
        top = max(held.values())
        greedy = {t for t, n in held.items() if n == top}
        if len(greedy) > 1:
            greedy = {max(greedy, key=lambda t: self.counters.get(t, 0.0))}
        return [c for c in pool if c.tenant in greedy][-1]
