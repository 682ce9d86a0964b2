"""Choosing, per weight shape, from how many rows the dynamic int8 kernel beats the weight-only one.

The crossover depends on the CPU (VNNI/AMX for `_int_mm`, AVX512-BF16 for the weight-only kernel)
and on the shape, so it is measured at start-up on the model's own shapes: a few milliseconds per
shape, well under a second for a small model. Without a measurement, the CPU's features give a
default. Only speed depends on the choice; both kernels are exact up to their error bounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from inferplane.worker.quant.int8_linear import Int8Dispatch, Int8Linear

# Beyond the largest measured row count the dynamic kernel is taken as the winner: GEMM there is
# compute-bound and int8 x int8 does four times the work per instruction.
ROW_COUNTS = (1, 2, 4, 8, 16)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_min_rows(flags: set[str] | None = None) -> int:
    """Without a measurement: VNNI or AMX makes `_int_mm` worth it from a few rows; without them
    the weight-only kernel is kept up to the largest measured row count."""
    flags = cpu_flags() if flags is None else flags
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return 4
    return ROW_COUNTS[-1] * 2


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up: first calls pay for packing buffers and thread start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_crossover(layer: Int8Linear, reps: int = 3) -> int:
    """The smallest measured row count from which the dynamic kernel is faster at every larger
    measured count; past the last one it is assumed faster."""
    wins = []
    with torch.inference_mode():
        for rows in ROW_COUNTS:
            x = torch.randn(rows, layer.in_features)
            dynamic = _median_seconds(lambda x=x: layer.forward_dynamic(x), reps)
            weight_only = _median_seconds(lambda x=x: layer.forward_weight_only(x), reps)
            wins.append(dynamic < weight_only)
    threshold = ROW_COUNTS[-1] * 2
    for rows, dynamic_wins in zip(reversed(ROW_COUNTS), reversed(wins), strict=True):
        if not dynamic_wins:
            break
        threshold = rows
    return threshold


def calibrate(layers: Iterable[Int8Linear], dispatch: Int8Dispatch,
              reps: int = 3) -> dict[tuple[int, int], int]:
    """Measures one layer of each distinct shape and stores its threshold in `dispatch`."""
    seen: dict[tuple[int, int], Int8Linear] = {}
    for layer in layers:
        seen.setdefault((layer.in_features, layer.out_features), layer)
    for (k, n), layer in seen.items():
        dispatch.set(k, n, measure_crossover(layer, reps))
    return dict(dispatch.thresholds)
