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

How many tokens a row proposes adapts to what it accepts (`DraftLength`): a miss halves the
attempts (a request proposes nothing for a while after misses, so plain chat keeps its decode
bursts), a full acceptance restores the configured number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inferplane.worker.engine.kv.manager import KVManager
from inferplane.worker.engine.scheduler import ScheduledSequence
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.engine.speculation.proposers import Proposal, RequestText, TenantHistory, history_key

MAX_COOLDOWN = 64  # output tokens a request waits, at most, before proposing again after misses
MAX_IDLE = 8  # output tokens a request waits, at most, before looking again after finding nothing


@dataclass
class DraftLength:
    """One request's proposal budget: at most `limit` tokens, none before output length `resume_at`.

    A miss (nothing kept) halves the limit and waits 2, 4, 8... tokens before proposing again; a
    step that found nothing to propose waits 1, 2, 4... (at most MAX_IDLE) before looking again.
    Meanwhile the row decodes in bursts (decode_bursts.py) up to `resume_at`, as without
    speculation, so text that does not repeat costs what it cost before."""

    limit: int
    resume_at: int = 0
    misses: int = 0
    idle: int = 0  # consecutive looks that found no proposal

    def update(self, proposed: int, accepted: int, most: int, output_len: int) -> None:
        self.idle = 0
        if accepted == proposed:
            self.limit, self.misses = most, 0
        elif accepted:
            self.limit, self.misses = max(1, accepted + 1), 0
        else:
            self.misses += 1
            self.limit = max(1, self.limit // 2)
            self.resume_at = output_len + min(MAX_COOLDOWN, 2 ** self.misses)

    def nothing_found(self, output_len: int) -> None:
        self.resume_at = output_len + min(MAX_IDLE, 2 ** self.idle)
        self.idle += 1


@dataclass
class SpeculationState:
    """What a running sequence keeps for speculation (Sequence.speculation)."""

    text: RequestText = field(default_factory=RequestText)
    length: DraftLength = field(default_factory=lambda: DraftLength(0))


@dataclass
class SpeculationCounters:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    verifications: int = 0  # rows that carried a draft
    skipped_no_room: int = 0  # drafts dropped because the KV pool had no block for them


def accepted_length(draft: list[int], tokens: list[int]) -> int:
    """How many draft tokens the verified rows kept: tokens[i] is what row i chose (row 0 at the
    last token's position); d_{i+1} is kept while it equals tokens[i]."""
    count = 0
    while count < len(draft) and tokens[count] == draft[count]:
        count += 1
    return count


class Speculator:
    """Proposes drafts for a step's decode rows (`attach`) and learns from their verification."""

    def __init__(self, method: str, num_tokens: int, kv: KVManager, max_model_len: int):
        """`method` and `num_tokens` as api.deployment.Speculative checked them."""
        self.method = method
        self.num_tokens = num_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.history = TenantHistory() if method == "suffix" else None
        self.counters = SpeculationCounters()

    @staticmethod
    def eligible(item: ScheduledSequence) -> bool:
        """A decode row past its first token, whose chosen tokens depend on nothing a draft would
        have to replay: no grammar (its state advances token by token) and no pending forks."""
        seq = item.seq
        return (item.num_new_tokens == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
                and seq.num_computed_tokens >= seq.num_prompt_tokens and seq.grammar is None and not seq.forks)

    def attach(self, batch: list[ScheduledSequence]) -> int:
        """Sets `draft` on the rows that propose this step (their KV made room for); returns how
        many rows carry one."""
        rows = 0
        for item in batch:
            if not self.eligible(item):
                continue
            seq = item.seq
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpeculationState(length=DraftLength(self.num_tokens))
            produced = len(seq.output_token_ids)
            room = min(state.length.limit, seq.max_tokens - produced - 1, self.max_model_len - seq.num_tokens)
            if room <= 0 or produced < state.length.resume_at:
                continue
            proposal = self._propose(seq, state, room)
            draft = proposal.tokens[:min(room, proposal.match)] if proposal is not None else []
            if not draft:
                state.length.nothing_found(produced)
                continue
            if not self.kv.allocate(seq, 1 + len(draft)):
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
            if space is not None:
                other = state.text.propose_history(seq, space, count)
                if other is not None and other.tokens and (found is None or other.match > found.match):
                    found = other
        return found if found is not None and found.tokens else None

    @staticmethod
    def burst_room(seq: Sequence) -> int:
        """Decode steps `seq` may run in one burst: up to where it proposes again (its first steps,
        before it looked at all: none)."""
        state = seq.speculation
        if state is None:
            return 1
        return max(1, state.length.resume_at - len(seq.output_token_ids))

    def verified(self, item: ScheduledSequence, accepted: int) -> None:
        seq, proposed = item.seq, len(item.draft)
        self.counters.proposed += proposed
        self.counters.accepted += accepted
        self.counters.verifications += 1
        seq.speculation.length.update(proposed, accepted, self.num_tokens, len(seq.output_token_ids))

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
        }
