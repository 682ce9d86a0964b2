"""Choosing, per weight shape, from how many rows the dynamic int8 kernel beats the weight-only one.

The crossover depends on the CPU (VNNI/AMX for `_int_mm`, AVX512-BF16 for the weight-only kernel)
and on the shape, so it is measured at start-up on the model's own shapes: a few milliseconds per
shape, well under a second for a small model. Without a measurement, the CPU's features give a
default. Only speed depends on the choice; both kernels are exact up to their error bounds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from inferplane.worker.ops import native
from inferplane.worker.ops.native.choice import NEVER, crossover
from inferplane.worker.quant.int8_linear import Int8Dispatch, Int8Linear

# Beyond the largest measured row count the dynamic kernel is taken as the winner: GEMM there is
# compute-bound and int8 x int8 does four times the work per instruction.
ROW_COUNTS = (1, 2, 4, 8, 16)


def default_min_rows(flags: frozenset[str] | None = None) -> int:
    """Without a measurement: VNNI or AMX makes `_int_mm` worth it from a few rows; without them
    the weight-only kernel is kept up to the largest measured row count."""
    flags = native.cpu_flags() if flags is None else flags
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        return 4
    return ROW_COUNTS[-1] * 2


def measure_crossover(layer: Int8Linear, reps: int = 3) -> int:
    """The smallest measured row count from which the dynamic kernel is faster at every larger
    measured count; past the last one it is assumed faster."""
    found = crossover(layer.forward_weight_only, layer.forward_dynamic,
                      lambda rows: torch.randn(rows, layer.in_features), ROW_COUNTS, reps)
    return ROW_COUNTS[-1] * 2 if found == NEVER else found


# Row counts at which a packed layer's kernel is timed against float32 GEMM over its dequantized
# weight: prefill sizes (below 16 rows the kernel reads a quarter of float32's bytes and wins).
PACKED_ROW_COUNTS = (16, 64, 256)


def measure_float_crossover(layer, reps: int = 3) -> int:
    """From how many rows a packed layer is faster as dequantize + float32 GEMM (NEVER: not here)."""
    def float_path(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.dequantized_weight(), layer.bias)

    return crossover(layer.forward_packed, float_path, lambda rows: torch.randn(rows, layer.in_features),
                     PACKED_ROW_COUNTS, reps)


def _one_per_shape(layers: Iterable[Int8Linear]) -> dict[tuple[int, int], Int8Linear]:
    seen: dict[tuple[int, int], Int8Linear] = {}
    for layer in layers:
        seen.setdefault((layer.in_features, layer.out_features), layer)
    return seen


def calibrate(layers: Iterable[Int8Linear], dispatch: Int8Dispatch,
              reps: int = 3) -> dict[tuple[int, int], int]:
    """Measures one unpacked layer of each distinct shape and stores its threshold in `dispatch`."""
    for (k, n), layer in _one_per_shape(layers).items():
        dispatch.set(k, n, measure_crossover(layer, reps))
    return dict(dispatch.thresholds)


def calibrate_packed(layers: Iterable, dispatch: Int8Dispatch,
                     reps: int = 3) -> dict[tuple[int, int], int]:
    """Measures one packed layer (Int8Linear or Q4Linear) of each distinct shape and kind against
    float32 GEMM over its dequantized weight; stores the crossovers."""
    if native.kernels() is None:
        return {}
    seen: dict[tuple[int, int, str], object] = {}
    for layer in layers:
        if layer.is_packed:
            seen.setdefault((layer.in_features, layer.out_features, layer.kind), layer)
    for (k, n, kind), layer in seen.items():
        dispatch.set_float_from(k, n, measure_float_crossover(layer, reps), kind)
    return dict(dispatch.float_from)
