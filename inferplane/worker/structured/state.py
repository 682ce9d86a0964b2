"""One sequence's place in its grammar: which tokens may come next, and what it has accepted.

A `GrammarState` is a copy of a compiled llguidance matcher (compiler.py) plus, for JSON outputs,
a `JsonTracker` (json_guard.py) that masks what the grammar cannot forbid (a repeated key, an
endless number). The engine asks it for one row of the batch's mask (masks.py fills all rows at
once), feeds it each sampled token, rolls it back or replays it after a preemption. A matcher that
gives up mid-output (`GrammarState.failure`) ends the request as an error, not as a `stop`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from inferplane.worker.structured.constraints import JSON_KINDS, KIND_NAMES, PARAM, Constraint, one_line, param_for
from inferplane.worker.structured.json_guard import MAX_NUMBER_CHARS, JsonTracker
from inferplane.worker.structured.masks import apply_token_bitmask_, bitmask_of, check_rows, new_bitmask

if TYPE_CHECKING:
    from inferplane.worker.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)


class GrammarState:
    """One sequence's position in its grammar: a copy of the compiled matcher (cheap). After a
    preemption (the engine recomputes) rebuild it with `replay(output_tokens)`.

    Terminated means the output is final: the grammar admits nothing more (EOS must follow) or EOS
    was accepted. From then on only EOS is allowed (and accepted, as a no-op). A matcher that gives
    up (llguidance's error state: a fuel bound hit mid-output) or whose mask allows nothing is
    *failed* (`failure`): its mask then allows only EOS, so that sampling stays defined, but the
    output does not satisfy the constraint and the engine must end it as an error, never a `stop`.
    """

    def __init__(self, compiler: GrammarCompiler, compiled, constraint: Constraint | None = None) -> None:
        self.compiler = compiler
        self.constraint = constraint
        self._compiled = compiled
        self.matcher = compiled.deep_copy()
        self._idle_eos = 0  # EOS accepted after termination: allowed, but the matcher takes no more
        self._accepted = 0
        self._failed: str | None = None  # why the mask could not be computed (llguidance's words)
        # JSON outputs: the keys of the open objects and the number being written (json_guard.py)
        json_kind = constraint is not None and constraint.kind in JSON_KINDS
        self.tracker = JsonTracker() if json_kind else None
        self._tokens: list[int] = []  # accepted tokens (the tracker is rebuilt from them on rollback)
        self._dead_end: str | None = None  # why only the tracker's blocking emptied the mask

    @property
    def failure(self) -> str | None:
        """None while the state is healthy; else the plain message the request ends with (naming
        the request field; llguidance's own text is logged, not returned)."""
        if self._failed is None and not self.matcher.is_error():
            return None
        self.fail(self.matcher.get_error() if self.matcher.is_error() else "")
        if self.constraint is None:
            where = PARAM
        else:
            where = f"{param_for(self.constraint.kind)}: {KIND_NAMES[self.constraint.kind]}"
        if self._dead_end:
            return f"{where}: after {self._accepted} output tokens {self._dead_end}; the output was discarded"
        return (f"{where}: the grammar engine gave up on this constraint after {self._accepted} output tokens "
                f"(too complex to enforce); the output was discarded")

    def refusal(self, token_id: int) -> str:
        """The message for a sampled token the grammar refused (the mask should have prevented it)."""
        where = param_for(self.constraint.kind) if self.constraint is not None else PARAM
        return self.failure or f"{where}: token {token_id} broke the constraint after {self._accepted} output tokens"

    def fail(self, reason: str) -> None:
        if self._failed is None:
            log.info("grammar state failed after %d tokens: %s", self._accepted, one_line(reason))
            self._failed = reason
            if self.constraint is not None:
                self.compiler.forget(self.constraint, self._compiled)

    def allowed_mask_into(self, target: torch.Tensor) -> None:
        """Writes the allowed next tokens: into a contiguous CPU int32 bitmask row (ceil(V/32) words;
        bit j of word w is token 32w+j), or onto a float logits row ([V], any device), whose
        disallowed entries become -inf."""
        if target.dtype == torch.int32:
            words = self.compiler.eos_mask.numel()
            if target.device.type != "cpu" or not target.is_contiguous() or target.numel() != words:
                raise ValueError(f"a bitmask row must be a contiguous CPU tensor of {words} int32 words")
            if self.allows_only_eos():
                target.copy_(self.compiler.eos_mask)
            else:
                self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
                self.clear_json_blocked(target)
                check_rows([self], target.view(1, -1))
            return
        bitmask = new_bitmask(1, self.compiler.vocab_size)
        self.allowed_mask_into(bitmask[0])
        apply_token_bitmask_(target.view(1, -1), bitmask.to(target.device))

    def allows_only_eos(self) -> bool:
        """Whether the next token can only be EOS without asking the matcher: the output is final,
        or the state failed (its mask is then EOS alone, so that sampling stays defined)."""
        return self.is_terminated() or bool(self._failed)

    def clear_json_blocked(self, row: torch.Tensor) -> None:
        """Clears, in this state's bitmask row that llguidance filled, what the JSON tracker blocks
        (json_guard.py): tokens that would close an open key as one its object already holds, or
        write more of a number that is full. A row this leaves empty fails with its own message
        rather than "too complex"."""
        if self.tracker is None or self.allows_only_eos():
            return
        blocked = self.tracker.blocked(self.compiler.token_index())
        if not blocked:
            return
        if not bool(row.any()):
            return  # already empty: llguidance's own failure
        row &= ~bitmask_of(blocked, self.compiler.vocab_size)
        if not bool(row.any()):
            self._dead_end = (f"the schema requires a number longer than {MAX_NUMBER_CHARS} characters"
                              if self.tracker.number_full() else
                              "every key the schema allows here repeats one already in its object "
                              "(JSON keys must differ)")

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (state unchanged, unless the matcher gave up: see
        `failure`) if the grammar does not allow it here."""
        if not 0 <= token_id < self.compiler.vocab_size or self._failed:
            return False  # (llguidance would enter its error state)
        if self.matcher.is_stopped():
            allowed = token_id in self.compiler.eos_token_ids and not self.matcher.is_error()
            self._idle_eos += allowed
            return allowed
        if self.tracker is not None and token_id in self.tracker.blocked(self.compiler.token_index()):
            return False  # it would repeat a key or overrun a number (the mask never offers it)
        # try_consume_tokens refuses without entering the error state, unlike consume_token (a
        # fuel bound hit while consuming does enter it).
        accepted = self.matcher.try_consume_tokens([token_id]) == 1
        self._accepted += accepted
        if accepted:
            self._took([token_id])
        return accepted

    def _took(self, tokens: Sequence[int]) -> None:
        """Accepted tokens go to the JSON tracker (EOS ends the text: its bytes are not JSON)."""
        if self.tracker is None:
            return
        self._tokens.extend(tokens)
        token_bytes = self.compiler.token_index().token_bytes
        eos = self.compiler.eos_token_ids
        for t in tokens:
            if t not in eos:
                self.tracker.feed(token_bytes[t])

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (cheap: llguidance keeps the history)."""
        idle = min(num_tokens, self._idle_eos)
        self._idle_eos -= idle
        if num_tokens > idle and not self.matcher.rollback(num_tokens - idle):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {one_line(self.matcher.get_error())}")
        self._accepted = max(0, self._accepted - (num_tokens - idle))
        if self.tracker is not None and num_tokens > idle:
            kept = self._tokens[:len(self._tokens) - (num_tokens - idle)]
            self.tracker, self._tokens = JsonTracker(), []
            self._took(kept)

    def reset(self) -> None:
        """Back to the start (a fresh copy, which also leaves any error state behind)."""
        self.matcher = self._compiled.deep_copy()
        self._idle_eos = 0
        self._accepted = 0
        self._failed = None
        self._dead_end = None
        if self.tracker is not None:
            self.tracker, self._tokens = JsonTracker(), []

    def replay(self, tokens: Sequence[int]) -> bool:
        """Resets, then accepts `tokens` (a preempted sequence's output so far). False if one is
        refused; the state then holds the tokens before it."""
        self.reset()
        tokens = [int(t) for t in tokens]
        in_range = next((i for i, t in enumerate(tokens) if not 0 <= t < self.compiler.vocab_size), len(tokens))
        if self.tracker is not None:  # one token at a time: each must also pass the tracker's check
            return all(self.accept(t) for t in tokens)
        done = self.matcher.try_consume_tokens(tokens[:in_range])  # one call for the bulk of them
        self._accepted = done
        return all(self.accept(t) for t in tokens[done:])

