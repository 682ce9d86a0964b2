"""SamplingParams (vLLM's field names) and the batched sampler.

Every request owns a 64-bit key, its `seed` (or fresh entropy), and the draw for its output token
at position t is a uniform number that depends on the key and t alone (`uniform_draw`: counter-based,
as Philox-style samplers are): a seeded request samples the same tokens whatever else shares its
batch, after a preemption, and after a move to another worker (which continues at the position it
resumes at, with no draws to replay). The token is drawn by inverse CDF at that number from the
filtered distribution: in C on the CPU (native/csrc/sample.c: no sort of the vocabulary), else by
the torch path below (sort, softmax, cumulative sum), which filters the same way.

Before choosing, each row's logits are adjusted as OpenAI and vLLM specify, in this order:
repetition penalty over prompt and output (vLLM/HF: a seen token's positive logit divided by it,
a negative one multiplied), frequency and presence penalties over the output so far (OpenAI:
logit - count * frequency - (count > 0) * presence), `logit_bias` added, and the stop tokens
masked while fewer than `min_tokens` were generated. Logprobs (and `top_logprobs`) are the
model's own distribution, before these adjustments and before temperature, as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from inferplane.worker.ops import native

MAX_N = 128  # OpenAI's bound on choices per request


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # tokens below min_p x the top token's probability are out (0: off)
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool | int | None = None
    top_logprobs: int = 0  # alternatives reported per token (with logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    # Structured output (inferplane.worker.structured.Constraint): the engine keeps a grammar state
    # per sequence and masks what the grammar does not allow.
    constraint: Any = None
    # Choices per request: the engine computes the prompt once and forks its KV blocks to the others.
    n: int = 1
    # The prompt's own logprobs (each token given those before it) with this many alternatives;
    # None: not computed. OpenAI's echo with logprobs needs them.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def validate(self, prompt_len: int, max_model_len: int) -> int:
        """Checks every field; returns the effective max_tokens (max_tokens, or the room the prompt
        leaves when it is None), which each of the request's sequences keeps as its own
        `Sequence.max_tokens`. Errors name the field (the gateway's 400 names it too).

        The worker's one check of a request, whichever way it came (gRPC or the Python API): the
        gateway checks the same ranges before it reserves anything, but the worker cannot assume
        that every caller is the gateway."""
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
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1] (0 disables it), got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty: must be in (0, 10], got {self.repetition_penalty}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs: must be in [0, 20], got {self.top_logprobs}")
        if any(not -100 <= bias <= 100 for bias in self.logit_bias.values()):
            raise ValueError("logit_bias: each bias must be in [-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be >= 0, got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs: must be in [0, 20], got {self.prompt_logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
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
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_tokens ({self.max_tokens})")
        return self.max_tokens

    def check_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Masks (to -inf) what top-k, min-p and top-p exclude, in csrc/sample.c's order: top-k and min-p
    (a token whose probability is below min_p x the top token's) first, then top-p over what is
    left. `logits` are temperature-scaled, rows are requests; k=0, p=1 and min_p=0 disable."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if min_p is not None and bool((min_p > 0).any()):
        cut = sorted_logits[:, :1] + torch.log(min_p.to(sorted_logits.dtype))[:, None]  # -inf where off
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cut, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


_MASK64 = (1 << 64) - 1


def uniform_draw(key: int, position: int) -> float:
    """The uniform number in (0, 1] that the request with `key` draws its output token at `position`
    (0: the first) by: SplitMix64 of key + (position + 1) x the golden ratio, its top 53 bits. A pure
    function of both, so draws never depend on the batch, the worker or what was drawn before."""
    z = (key + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return ((z >> 11) + 1) / float(1 << 53)


def _draw_rows(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
               min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token by inverse CDF at its uniform (float64, (0, 1]) from softmax(scaled) filtered
    by top-k, min-p and top-p: the torch path (a GPU, or a CPU without the C kernels)."""
    probs = _filter_rows(scaled, top_k, top_p, min_p).softmax(dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    chosen = torch.searchsorted(cdf, target).squeeze(-1)
    return chosen.clamp_(max=probs.shape[-1] - 1)


@dataclass(frozen=True)
class History:
    """What a row's adjustments read: the prompt, what it generated, and its stop tokens."""

    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None = None  # of each chosen token, when any row asked
    top: list[list[tuple[int, float]]] | None = None  # per row: (token, logprob), best first
    # per row: the tokens of a burst of greedy decode steps (ModelRunner.execute's `steps`), the
    # first of which is tokens[row]; None: one step ran
    bursts: list[list[int]] | None = None


@dataclass
class TokenLogprob:
    """A given token's logprob under the model and the `top` best alternatives (token, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


def given_token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row i's log-softmax at tokens[i], with its `top` best alternatives: the model's own
    distribution, as sampled logprobs are reported (no penalties, no temperature)."""
    raw = logits.float().log_softmax(dim=-1)
    chosen = raw.gather(-1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(-1).tolist()
    if not top:
        return [TokenLogprob(lp, []) for lp in chosen]
    values, ids = raw.topk(top, dim=-1)
    return [TokenLogprob(lp, list(zip(ids[i].tolist(), values[i].tolist(), strict=True)))
            for i, lp in enumerate(chosen)]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [rows, vocab] tensor, by the C kernel for float32 on the CPU
    (PyTorch's took 0.7 ms of a 16-row SmolLM2 step there, the kernel about 0.05)."""
    kernels = native.kernels() if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 else None
    return kernels.argmax_rows(x) if kernels is not None else x.argmax(dim=-1)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> None:
    """Applies each row's penalties, bias and min_tokens mask in place (see the module docstring)."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        row = logits[i]
        history = histories[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history.prompt_ids) | set(history.output_ids)), device=row.device,
                                dtype=torch.long)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and history.output_ids:
            counts = torch.bincount(torch.tensor(history.output_ids, device=row.device), minlength=vocab)[:vocab]
            row -= counts.to(row.dtype) * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device, dtype=torch.long)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device, dtype=row.dtype)
        if len(history.output_ids) < p.min_tokens and history.stop_ids:
            row[torch.tensor(sorted(history.stop_ids), device=row.device, dtype=torch.long)] = float("-inf")


def sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: Sequence[float],
           want_logprobs: bool, histories: list[History] | None = None,
           grammars: Sequence[Any] | None = None, argmax: torch.Tensor | None = None) -> Sampled:
    """logits: [S, V] float32, one row per sequence that samples this step. `uniforms`: per row its
    draw (`uniform_draw` of its key and position; unused by greedy rows). `grammars`: per row a
    structured-output state (or None), whose disallowed tokens are masked after the adjustments.
    `argmax`: each row's argmax of these logits where it is known already (the fused CPU decode
    computes it in its C call); used where nothing adjusts or masks them, and written over."""
    raw = None
    if want_logprobs:
        raw = logits.log_softmax(dim=-1)
    adjusting = histories is not None and any(p.adjusts_logits for p in params)
    masking = grammars is not None and any(g is not None for g in grammars)
    if adjusting or masking:
        logits = logits.clone()  # the model's logits stay as they were
    if adjusting:
        adjust_logits(logits, params, histories)
    if masking:
        from inferplane.worker.structured import apply_masks

        apply_masks(logits, grammars)
    chosen = argmax if argmax is not None and not (adjusting or masking) else argmax_rows(logits)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        dev = logits.device
        temps = torch.tensor([params[i].temperature for i in random_rows], device=dev, dtype=logits.dtype)
        top_k = torch.tensor([params[i].top_k for i in random_rows], device=dev)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=dev, dtype=logits.dtype)
        min_p = torch.tensor([params[i].min_p for i in random_rows], device=dev, dtype=logits.dtype)
        draws = torch.tensor([uniforms[i] for i in random_rows], dtype=torch.float64)
        kernels = native.kernels() if dev.type == "cpu" and logits.dtype == torch.float32 else None
        if kernels is not None:
            chosen[rows] = kernels.sample_rows(logits[rows], temps, top_k.to(torch.int64), top_p, min_p, draws)
        else:
            chosen[rows] = _draw_rows(logits[rows] / temps[:, None], top_k, top_p, draws, min_p)
    result = Sampled(chosen.tolist())
    if raw is not None:
        result.logprobs = raw.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        k = max(p.top_logprobs for p in params)
        if k:
            values, ids = raw.topk(k, dim=-1)
            result.top = [list(zip(ids[i, :p.top_logprobs].tolist(), values[i, :p.top_logprobs].tolist(), strict=True))
                          for i, p in enumerate(params)]
    return result
