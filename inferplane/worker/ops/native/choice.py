"""Start-up measurements: from how many rows a PyTorch path beats a C kernel on this CPU.

A kernel that wins on one CPU can lose on another: on this project's AVX-512 machine the AVX2 int8
kernel took 1.5x float32 GEMM's time at 512 rows (MKL's float GEMM uses AVX-512 there), and the
float32 head kernel, 2.2x faster than PyTorch for one row, lost at 16. So where both paths exist,
the worker times them on its own shapes when it starts (a fraction of a second) and each layer
uses the kernel only below the measured crossover: no path is slower than PyTorch's float32.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

NEVER = 1 << 30  # a crossover that was not reached: the kernel won at every measured row count


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first calls pay for buffers and thread start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def crossover(first: Callable[[torch.Tensor], object], second: Callable[[torch.Tensor], object],
              make_input: Callable[[int], torch.Tensor], row_counts: Sequence[int], reps: int = 3) -> int:
    """The smallest measured row count from which `second` is faster there and at every larger
    measured count; NEVER where `first` wins at the largest. Past the last count the winner there
    is assumed to keep winning (both are GEMMs; their ratio settles as rows grow). Counts are timed
    from the largest down and the first loss ends it: smaller counts cannot change the answer, and
    start-up pays for fewer timings (one, where the kernel wins at the largest count)."""
    threshold = NEVER
    with torch.inference_mode():
        for rows in sorted(row_counts, reverse=True):
            x = make_input(rows)
            t_first = median_seconds(lambda x=x: first(x), reps)
            t_second = median_seconds(lambda x=x: second(x), reps)
            if t_second >= t_first:
                break
            threshold = rows
    return threshold
