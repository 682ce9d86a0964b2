"""Batch-1 decode as a fraction of the memory-bandwidth bound, each timing paired with the bandwidth
of its own moment.

Why paired: on a shared machine the read bandwidth switches between levels for seconds at a time
(29 to 59 GB/s within one bench run on this project's 2-core EPYC), and a decode timing slows with
it. The fastest decode over the fastest read can take the two from different levels, and then the
fraction says more about the neighbours than about the kernels. Here each timing of G tokens is
flanked by two reads and compared with the faster of them, which is the bound of that moment (taking
the faster keeps a read slowed by a passing disturbance from flattering the decode).

bench cpu judges the target on the median round: a typical moment, not the luckiest one.

Invariant: a round's fraction is (G - 1) tokens over t(G) - t(1) (t(1): the fastest one-token run,
the prompt and the first token), times the weight bytes a token reads, over the faster flanking read.
A timing at or below t(1) was disturbed and gives no figure (nan), as decode_rates does.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from inferplane.bench.bandwidth import ReadBandwidth


@dataclass
class PairedFractions:
    """One fraction per round (nan where the round's timing was disturbed)."""

    fractions: list[float]

    def _measured(self) -> list[float]:
        return [f for f in self.fractions if not math.isnan(f)]

    @property
    def best(self) -> float:
        return max(self._measured(), default=math.nan)

    @property
    def median(self) -> float:
        measured = self._measured()
        return statistics.median(measured) if measured else math.nan


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired_fractions(generate: Callable[[int], None], reader: ReadBandwidth, bytes_per_token: float,
                     new_tokens: int, rounds: int) -> PairedFractions:
    """`rounds` timings of generate(new_tokens), each between two bandwidth reads, as fractions of the
    bound of their moment; generate(n) runs one sequence to n new tokens."""
    t_one = min(_timed(lambda: generate(1)) for _ in range(3))
    fractions = []
    for _ in range(rounds):
        before = reader.read()
        seconds = _timed(lambda: generate(new_tokens))
        after = reader.read()
        if seconds <= t_one:
            fractions.append(math.nan)
            continue
        rate = (new_tokens - 1) / (seconds - t_one)
        fractions.append(rate * bytes_per_token / max(before, after))
    return PairedFractions(fractions)
