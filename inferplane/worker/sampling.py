"""SamplingParams (vLLM's field names) and the batched sampler.

Every request owns a torch.Generator seeded from its `seed` (or from fresh entropy), so a seeded
request samples the same tokens whatever else shares its batch, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool | int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self, prompt_len: int, max_model_len: int) -> int:
        """Checks every field; returns the effective max_tokens. Errors name the field."""
        if prompt_len <= 0:
            raise ValueError("prompt: must not be empty")
        if prompt_len >= max_model_len:
            raise ValueError(
                f"prompt: {prompt_len} tokens leave no room to generate within the context length {max_model_len}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        room = max_model_len - prompt_len
        if self.max_tokens is None:
            return room
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.max_tokens > room:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                f"context length {max_model_len}"
            )
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) what top-k and top-p exclude; rows are requests, k=0 and p=1 disable."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """logits: [S, V] float32, one row per sequence that samples this step."""
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        dev = logits.device
        temps = torch.tensor([params[i].temperature for i in random_rows], device=dev, dtype=logits.dtype)
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=dev, dtype=logits.dtype)
        scaled = _filter_top_k_top_p(logits[rows] / temps[:, None], top_k, top_p)
        probs = scaled.softmax(dim=-1)
        # Exponential-race sampling (argmax of p / Exp(1)) equals drawing from p; the noise comes
        # from each request's own generator, so the draw does not depend on the batch.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in random_rows])
        chosen[rows] = (probs / noise).argmax(dim=-1)
    logprobs = None
    if want_logprobs:
        logprobs = logits.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1).tolist()
    return chosen.tolist(), logprobs
