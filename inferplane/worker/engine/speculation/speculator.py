"""Speculative decoding's engine side: which decode rows carry proposed tokens this step, how many,
and what their verification taught.

A decode row with a draft d1..dk runs k + 1 rows in the step's one forward (ModelRunner): the last
token and the draft, at positions p..p+k, each a decode row over the same blocks with one more
position of context, so the C fused decode, the Triton and the gather kernels verify them as they
decode any batch. Each row's token is then chosen exactly as a plain decode step would choose it
at that position (the same logits adjustments and the same counter-based draw,
sampling.uniform_draw(key, position)); the engine keeps tokens while each equals the next draft
token, and the first that differs ends the run (verify.accepted_length). For a greedy row that is
the exact-match rule; for a sampled row it is rejection sampling with a deterministic proposal: d
is kept with the probability the target gives it, and a rejected position's token is the target's
draw conditioned on not being d, which is the residual distribution. Either way each emitted
token is the one the plain path would have emitted: the output is the same tokens, seeded or not.

KV of rejected positions was written into the sequence's own blocks past its computed length; the
next step writes over it, and nothing reads or publishes a position before it is computed (the
radix tree takes full computed blocks only).

How many tokens a row proposes is what pays (`worth_proposing`): the i-th draft token is kept with
probability a ** i (a: the request's measured acceptance, `Acceptance`) and costs a row, whose share
of the step is measured (`StepCost`: on a 2-core CPU a row is a fifth of a batch-1 step, so a batch
of 8 affords short drafts only). A miss makes the request wait before proposing again (`Cooldown`),
and meanwhile it decodes in bursts as without speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.scheduler import ScheduledSequence
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.speculation.proposers import Proposal, RequestText, TenantHistory, history_key

MAX_COOLDOWN = 64  # output tokens a request waits, at most, before proposing again after misses
MAX_IDLE = 8  # output tokens a request waits, at most, before looking again after finding nothing
PROBE_EVERY = 16  # output tokens between proposals of a request whose acceptance does not pay for a row
ACCEPTANCE_DECAY = 0.8  # weight of a request's earlier verifications against its newest
STEP_COST_DECAY = 0.9  # weight of the earlier steps in StepCost's averages
BURST_GAIN = 0.15  # tokens per row a burst's step saves on the CPU (Python and calls paid once for several steps)
PRIOR_ROW_SHARE = 0.2  # a row's share of a batch-1 step before any is measured (SmolLM2 on 2 CPU cores)


@dataclass
class Cooldown:
    """When a request looks for a proposal again (output length `resume_at`).

    A miss (nothing kept) waits 2, 4, 8... tokens (at most MAX_COOLDOWN); a look that found nothing
    to propose waits 1, 2, 4... (at most MAX_IDLE). Meanwhile the row decodes in bursts
    (decode_bursts.py) up to `resume_at`, as without speculation, so text that does not repeat
    costs what it cost before."""

    resume_at: int = 0
    misses: int = 0
    idle: int = 0  # consecutive looks that found no proposal

    def verified(self, accepted: int, output_len: int) -> None:
        self.idle = 0
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.resume_at = output_len + min(MAX_COOLDOWN, 2 ** self.misses)

    def nothing_found(self, output_len: int) -> None:
        self.resume_at = output_len + min(MAX_IDLE, 2 ** self.idle)
        self.idle += 1

    def probe(self, output_len: int) -> None:
        """A proposal that is not expected to pay is made only every PROBE_EVERY tokens."""
        self.resume_at = max(self.resume_at, output_len + PROBE_EVERY)


@dataclass
class Acceptance:
    """A request's chance that a draft token is kept once those before it were: kept over tried
    (a verification of k tokens keeping a tried min(a + 1, k) and kept a), recent ones weighing
    most; the prior is 1 of 2 (a new request proposes two tokens at batch 1 on a 2-core CPU, and
    where a row costs more than half a token, only probes until its own figures say more)."""

    kept: float = 1.0
    tried: float = 2.0

    def update(self, proposed: int, accepted: int) -> None:
        self.kept = ACCEPTANCE_DECAY * self.kept + accepted
        self.tried = ACCEPTANCE_DECAY * self.tried + min(accepted + 1, proposed)

    @property
    def rate(self) -> float:
        return self.kept / self.tried


class StepCost:
    """What one more row costs a step, as a share of the step's tokens, per batch size: measured
    as the time a step with draft rows took over a plain step of the same batch (an average of
    each, recent steps weighing most). Why measured: a row's cost is compute (its attention over
    the context, its share of every linear), which on a 2-core CPU is a fifth of a batch-1 SmolLM2
    step and two thirds of a token at batch 8, and on a GPU next to nothing. Why per batch size:
    one straight line through every step put a batch of 8's costs onto a batch of 1."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # batch size -> seconds of a decode step without drafts
        self.per_row: dict[int, float] = {}  # batch size -> seconds one draft row added

    def observe(self, batch: int, draft_rows: int, seconds: float) -> None:
        d = STEP_COST_DECAY
        if not draft_rows:
            before = self.plain.get(batch)
            self.plain[batch] = seconds if before is None else d * before + (1 - d) * seconds
            return
        plain = self.plain.get(batch)
        if plain is None:
            return
        added = max(0.0, (seconds - plain) / draft_rows)
        before = self.per_row.get(batch)
        self.per_row[batch] = added if before is None else d * before + (1 - d) * added

    def row_share(self, batch: int) -> float:
        """One more row's cost in the step's tokens: per_row * batch / plain step time (a draft
        token pays where it is kept with at least this probability); before both were measured
        at this batch size, PRIOR_ROW_SHARE of a batch-1 step, growing with the batch as if each
        row cost that much."""
        plain, per_row = self.plain.get(batch), self.per_row.get(batch)
        if plain is None or per_row is None:
            return PRIOR_ROW_SHARE * batch / (1 + PRIOR_ROW_SHARE * (batch - 1))
        return min(1.0, per_row * batch / max(plain, 1e-9))


def worth_proposing(acceptance: float, row_share: float) -> int:
    """Draft tokens worth verifying: the i-th is kept with probability acceptance ** i and costs
    row_share, so the longest run where acceptance ** i > row_share; 0 where not even one pays."""
    if acceptance >= 1.0 or row_share <= 0.0:
        return 16
    if acceptance <= 0.0 or row_share >= 1.0:
        return 0
    return max(0, math.ceil(math.log(row_share) / math.log(acceptance)) - 1)


@dataclass
class SpeculationState:
    """What a running sequence keeps for speculation (Sequence.speculation)."""

    text: RequestText = field(default_factory=RequestText)
    cooldown: Cooldown = field(default_factory=Cooldown)
    acceptance: Acceptance = field(default_factory=Acceptance)


@dataclass
class SpeculationCounters:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    verifications: int = 0  # rows that carried a draft
    skipped_no_room: int = 0  # drafts dropped because the KV pool had no block for them
    dropped_for_bursts: int = 0  # drafts not verified: together they were not worth a step's burst


def accepted_length(draft: list[int], tokens: list[int]) -> int:
    """How many draft tokens the verified rows kept: tokens[i] is what row i chose (row 0 at the
    last token's position); d_{i+1} is kept while it equals tokens[i]."""
    count = 0
    while count < len(draft) and tokens[count] == draft[count]:
        count += 1
    return count


class Speculator:
    """Proposes drafts for a step's decode rows (`attach`) and learns from their verification."""

    def __init__(self, method: str, num_tokens: int, kv: KVManager, max_model_len: int, device_bursts: bool = True):
        """`method` and `num_tokens` as api.deployment.Speculative checked them; `device_bursts`:
        whether plain decode steps may run in bursts here (the CPU), which a step with drafts forgoes."""
        self.method = method
        self.num_tokens = num_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.history = TenantHistory() if method == "suffix" else None
        self.counters = SpeculationCounters()
        self.cost = StepCost()
        self.device_bursts = device_bursts

    @staticmethod
    def eligible(item: ScheduledSequence) -> bool:
        """A decode row past its first token, whose chosen tokens depend on nothing a draft would
        have to replay: no grammar (its state advances token by token) and no pending forks."""
        seq = item.seq
        return (item.num_new_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
                and seq.num_computed_tokens >= seq.num_prompt_tokens and seq.grammar is None and not seq.forks)

    def attach(self, batch: list[ScheduledSequence]) -> int:
        """Sets `draft` on the rows that propose this step (their KV made room for); returns how
        many rows carry one. A step with drafts runs alone, never in a burst of several steps, so
        its drafts together must be expected to add at least BURST_GAIN tokens per row of the
        batch (what a burst saves a step on the CPU); else none is verified this step."""
        share = self.cost.row_share(len(batch))
        found: list[tuple[ScheduledSequence, list[int]]] = []
        expected = 0.0  # draft tokens the step is expected to keep
        for item in batch:
            if not self.eligible(item):
                continue
            seq = item.seq
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpeculationState()
            produced = len(seq.output_token_ids)
            if produced < state.cooldown.resume_at:
                continue
            rate = state.acceptance.rate
            worth = worth_proposing(rate, share)
            if not worth:  # a probe of one token, after a wait: the acceptance may have changed
                worth = 1
                state.cooldown.probe(produced)
            room = min(self.num_tokens, worth, seq.max_tokens - produced - 1, self.max_model_len - seq.num_tokens)
            if room <= 0:
                continue
            proposal = self._propose(seq, state, room)
            draft = proposal.tokens[:min(room, proposal.match)] if proposal is not None else []
            if not draft:
                state.cooldown.nothing_found(produced)
                continue
            found.append((item, draft))
            expected += sum(rate ** i for i in range(1, len(draft) + 1))
        if self.device_bursts and expected < BURST_GAIN * len(batch):
            self.counters.dropped_for_bursts += len(found)
            return 0
        rows = 0
        for item, draft in found:
            if not self.kv.allocate(item.seq, 1 + len(draft)):
                self.counters.skipped_no_room += 1
                continue
            item.draft = draft
            rows += 1
        return rows

    def _propose(self, seq: Sequence, state: SpeculationState, count: int) -> Proposal | None:
        state.text.sync(seq)
        found = state.text.propose_own(count)
        if self.history is not None:
            space = self.history.get(history_key(seq))
            if space is not None:  # walked every step, so that its match is current when it is needed
                other = state.text.propose_history(seq, space, count)
                # the request's own text first: another request's longer match diverges where the
                # two requests differ (another rename, another question), its own where it is copying
                if (found is None or not found.tokens) and other is not None:
                    found = other
        return found if found is not None and found.tokens else None

    @staticmethod
    def burst_room(seq: Sequence) -> int:
        """Decode steps `seq` may run in one burst: up to where it proposes again (its first steps,
        before it looked at all: none)."""
        state = seq.speculation
        if state is None:
            return 1
        return max(1, state.cooldown.resume_at - len(seq.output_token_ids))

    def verified(self, item: ScheduledSequence, accepted: int) -> None:
        seq, proposed = item.seq, len(item.draft)
        self.counters.proposed += proposed
        self.counters.accepted += accepted
        self.counters.verifications += 1
        state = seq.speculation
        state.acceptance.update(proposed, accepted)
        state.cooldown.verified(accepted, len(seq.output_token_ids))

    def observe_step(self, batch: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step of `batch` sequences and `draft_rows` draft rows took `seconds`."""
        self.cost.observe(batch, draft_rows, seconds)

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: its text joins its namespace's history (`suffix`)."""
        if self.history is not None and seq.output_token_ids:
            self.history.add(history_key(seq), seq.all_token_ids)
        seq.speculation = None

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {  # labelled by method (serve/metrics.py reads the part after the colon)
            f"spec_proposed_tokens_total:{self.method}": c.proposed,
            f"spec_accepted_tokens_total:{self.method}": c.accepted,
            f"spec_verifications_total:{self.method}": c.verifications,
            "spec_skipped_no_room_total": c.skipped_no_room,
            "spec_dropped_for_bursts_total": c.dropped_for_bursts,
        }
