"""Where a batch-1 decode step's time goes: the fused decoder layers (one C call, which runs the final
norm and the output head too where their kernels are C's), the head where it runs after that call,
and the rest (the engine's Python, embedding, sampling).

Why: the bound fraction says how far batch-1 decode is from the memory bandwidth, not why; this
splits the step so the next change aims at the part that is slow. The two calls are timed by
wrapping them on the objects the engine calls (the loaded kernels and the model's head) for the
measurement only; prefill is taken out by timing a one-token generate of the same prompt first.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

ROUNDS = 3


@dataclass
class StepSplit:
    """Milliseconds per decode token."""

    layers: float
    head: float  # 0.0 where the head ran inside the layers' call (head_in_call)
    rest: float
    head_in_call: bool = False

    def describe(self) -> str:
        layers = "fused decoder layers, final norm and head (one C call)" if self.head_in_call else \
            "fused decoder layers"
        head = "" if self.head_in_call else f", head {self.head:.2f}"
        return (f"batch-1 step {self.total:.2f} ms: {layers} {self.layers:.2f}{head}, the rest (engine, embedding, "
                f"sampling) {self.rest:.2f}")

    @property
    def total(self) -> float:
        return self.layers + self.head + self.rest


@contextmanager
def timed_attribute(owner, name: str, spent: list[float]):
    """owner.name wrapped to add its wall time to spent[0]; restored on exit (also
    scripts/profile_engine.py's step split)."""
    real = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(owner, name, timed)
    try:
        yield
    finally:
        delattr(owner, name)  # the class's (or module's) own attribute again


def step_split(llm, prompt: list[int], new_tokens: int) -> StepSplit | None:
    """Batch-1 greedy decode of `new_tokens` after `prompt`, split per token; None where the
    model has no fused decode on the C kernels (nothing to split)."""
    from inferplane.worker.engine.sampling import SamplingParams
    from inferplane.worker.ops import native

    kernels = native.kernels()
    head = getattr(llm.engine.loaded.model, "lm_head", None)
    if kernels is None or head is None:
        return None
    layers, head_time = [0.0], [0.0]

    def run(tokens: int) -> tuple[float, float, float]:
        layers[0] = head_time[0] = 0.0
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start, layers[0], head_time[0]

    # decode_steps: a burst of greedy steps in one call (engine/decode_bursts.py), the same layers
    with timed_attribute(kernels, "decode_layers", layers), timed_attribute(kernels, "decode_steps", layers), \
            timed_attribute(head, "forward", head_time):
        run(new_tokens + 1)  # warm
        # The fastest of a few runs each: one disturbed run (a busy moment) made the difference of
        # two single runs meaningless (a step of 0.85 ms with "the rest" at -8 ms, at 2,000 tokens).
        base = min((run(1) for _ in range(ROUNDS)), key=lambda timed: timed[0])  # prefill and the first token
        full = min((run(new_tokens + 1) for _ in range(ROUNDS)), key=lambda timed: timed[0])
    if full[1] == 0.0:
        return None
    total, fused, head_spent = ((f - b) * 1e3 / new_tokens for f, b in zip(full, base, strict=True))
    in_call = llm.engine.loaded.model.fused_head(1) is not None
    head_spent = 0.0 if in_call else head_spent  # the prefill's head alone, which `base` holds too
    return StepSplit(layers=fused, head=head_spent, rest=total - fused - head_spent, head_in_call=in_call)
