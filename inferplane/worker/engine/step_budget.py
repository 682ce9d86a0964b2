"""How many tokens one engine step may take, sized by measured step time.

A fixed budget (max_num_batched_tokens, thousands by the runtime's preset) suits a GPU, where 2048
prompt tokens take milliseconds. On a CPU the same chunk can take seconds (and took minutes where PyTorch's int8 ops
were slow): every running sequence waits that long for its next token, and the time to first
token of everything queued behind grows with it. So the engine times each step that carried a
prefill chunk and sizes the next budget to fit `target_s`: seconds per token is a running average
over such steps, the budget is target / that, clamped to [MIN_TOKENS, max_num_batched_tokens].
Until the first measurement it is INITIAL_TOKENS. Decode steps are not measured: a step of one
token per sequence says little about what a prompt token costs.

Invariant: the budget never drops below the running sequences' decodes plus MIN_TOKENS (see
`tokens_for`), so a small budget slows prefill, never decoding.
"""

from __future__ import annotations

MIN_TOKENS = 32
INITIAL_TOKENS = 256
_SMOOTHING = 0.3  # weight of the newest measurement


class StepBudget:
    def __init__(self, max_tokens: int, target_s: float):
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.seconds_per_token: float | None = None

    def tokens(self) -> int:
        """The budget for the next step (max_tokens when sizing is off)."""
        if self.target_s <= 0:
            return self.max_tokens
        if self.seconds_per_token is None:
            return min(self.max_tokens, INITIAL_TOKENS)
        return max(MIN_TOKENS, min(self.max_tokens, int(self.target_s / self.seconds_per_token)))

    def tokens_for(self, running: int) -> int:
        """The budget when `running` sequences each want a decode token."""
        return min(self.max_tokens, max(self.tokens(), running + MIN_TOKENS))

    def observe(self, prefill_tokens: int, total_tokens: int, seconds: float) -> None:
        """One step's measurement: `prefill_tokens` of its `total_tokens` were prompt tokens."""
        if self.target_s <= 0 or prefill_tokens < MIN_TOKENS or total_tokens <= 0:
            return
        rate = seconds / total_tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * rate
