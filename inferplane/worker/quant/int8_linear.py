"""An int8 linear layer for the CPU: symmetric per-output-channel int8 weights, three kernels.

- dynamic: each row (token) of the input is quantized to int8 with its own scale, then
  `torch._int_mm` (int8 x int8 -> int32, VNNI on x86) does the product. It wins from a few rows on,
  where float32 GEMM is compute-bound.
- weight-only: `torch._weight_int8pack_mm` reads the int8 weights directly and multiplies them by the
  input in bfloat16 (float32 accumulation). For one or two rows a GEMV is memory-bound, and this
  kernel reads a quarter of the float32 bytes without the per-call cost of quantizing the input.
- packed (see `pack()`): the worker's C kernel (worker/native) with the weight laid out once, at
  load time, in the order its AVX-512 VNNI loop reads; each input row is quantized inside the call
  exactly as for the dynamic kernel, and integer accumulation is exact, so the result equals the
  dynamic kernel's. It beat both others at every row count measured (1 to 64) for SmolLM2's shapes,
  so a packed layer uses it for all inputs; the plain copy of the weight is dropped. Except: from
  the row count where float32 GEMM over the dequantized weight measured faster at start-up (it
  can, for prefill-sized inputs, on a CPU whose int8 path is AVX2 but whose float GEMM is not
  slower), a packed layer dequantizes (a C kernel, a fraction of the GEMM's time) and uses that.

Without the C kernels (no compiler, another CPU), the choice between the first two for a given row
count is a per-shape threshold held in a shared `Int8Dispatch`, set at start-up by a measurement
(dispatch.py) or from the CPU's features.
Activations stay float32 between layers; only the inside of each product uses narrower types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from inferplane.worker.ops import native
from inferplane.worker.ops.native.choice import NEVER
from inferplane.worker.ops.structure import WatchedModule

QMAX = 127  # symmetric: -127..127, so that negating a weight never overflows


def quantize_per_channel(weight: torch.Tensor,
                         scale_multiplier: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]) with weight ~= q * scale[:, None].

    `scale_multiplier` != 1 deliberately stores wrong scales (the values are rounded with the true
    scale, then the stored scale is multiplied): the quality gate must catch that.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = (amax / QMAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale * scale_multiplier


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    # One division by the [M, 1] scale, built in place: 15 us for 16 rows of 576, where multiplying
    # by a freshly allocated reciprocal took 26 (four of these run per layer and step).
    return x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(QMAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) symmetric int8: x [M, K] float -> (int8 [M, K], float32 scale [M, 1])."""
    scale = _row_scales(x)
    return x.div(scale).round_().to(torch.int8), scale


class Int8Dispatch:
    """Row-count thresholds per weight shape: inputs with at least `min_rows(k, n)` rows use the dynamic
    int8 kernel, fewer rows the weight-only kernel. One instance is shared by all layers of a model so
    that a start-up measurement configures them all at once."""

    def __init__(self, default_min_rows: int = 4):
        self.default_min_rows = default_min_rows
        self.thresholds: dict[tuple[int, int], int] = {}
        # packed (and Q4_1) layers: from how many rows float32 GEMM over the dequantized weight is
        # faster, by (in, out, weight kind)
        self.float_from: dict[tuple[int, int, str], int] = {}
        self.version = 0  # bumped by every change above: what is cached by row count is then stale

    def min_rows(self, in_features: int, out_features: int) -> int:
        return self.thresholds.get((in_features, out_features), self.default_min_rows)

    def set(self, in_features: int, out_features: int, min_rows: int) -> None:
        self.thresholds[(in_features, out_features)] = min_rows
        self.version += 1

    def float_min_rows(self, in_features: int, out_features: int, kind: str = "int8") -> int:
        return self.float_from.get((in_features, out_features, kind), NEVER)

    def set_float_from(self, in_features: int, out_features: int, rows: int, kind: str = "int8") -> None:
        self.float_from[(in_features, out_features, kind)] = rows
        self.version += 1

    @contextlib.contextmanager
    def int8_only(self) -> Iterator[None]:
        """Packed (and Q4_1) layers use their kernel for every row count inside (the quality gate
        measures that path: decode always takes it)."""
        saved, self.float_from = self.float_from, {}
        self.version += 1
        try:
            yield
        finally:
            self.float_from = saved
            self.version += 1


class Int8Linear(WatchedModule):
    """Drop-in replacement for `nn.Linear` (same call signature, float32 in and out)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dispatch: Int8Dispatch | None = None):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be a 2-D int8 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("packed_weight", None)
        self.register_buffer("scale", scale.float().contiguous())
        # The weight-only kernel wants bfloat16 scales; exact ones keep the float32 scale exact.
        ones = torch.ones(self.out_features, dtype=torch.bfloat16)
        self.register_buffer("unit_scale", ones, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.dispatch = dispatch or Int8Dispatch()

    @classmethod
    def from_linear(cls, linear: nn.Linear, dispatch: Int8Dispatch | None = None,
                    scale_multiplier: float = 1.0) -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight, scale_multiplier)
        return cls(q, scale, linear.bias, dispatch)

    @property
    def is_packed(self) -> bool:
        return self.packed_weight is not None

    def pack(self) -> bool:
        """Moves the weight into the C kernel's layout for good (every row count then uses it);
        False, and nothing changed, where the kernel is unavailable or the shape does not fit it."""
        if self.is_packed:
            return True
        kernels = native.kernels()
        if kernels is None or not kernels.has_int8_linear:
            return False
        if not native.int8_shape_supported(self.out_features, self.in_features):
            return False
        self.packed_weight = native.pack_int8_weight(self.qweight)
        self.qweight = None
        self._kernels = kernels
        return True

    def int8_weight(self) -> torch.Tensor:
        """The int8 values [N, K], from whichever layout holds them."""
        return native.unpack_int8_weight(self.packed_weight) if self.is_packed else self.qweight

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as float32, scales applied; from a packed layer by the C kernel in one pass
        (what its float32 GEMM path multiplies by, per call)."""
        if self.is_packed:
            return self._kernels.int8_dequantize(self.packed_weight, self.scale)
        return self.qweight.float() * self.scale[:, None]

    def weight_bytes(self) -> int:
        """Bytes this layer keeps for its weight: int8 values plus the float32 scales."""
        weight = self.packed_weight if self.is_packed else self.qweight
        return weight.numel() * weight.element_size() + self.scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.is_packed:
            if x2.shape[0] >= self.float_rows():
                y = torch.nn.functional.linear(x2.float(), self.dequantized_weight(), self.bias)
            else:
                y = self.forward_packed(x2)
        elif x2.shape[0] >= self.dispatch.min_rows(self.in_features, self.out_features):
            y = self.forward_dynamic(x2)
        else:
            y = self.forward_weight_only(x2)
        return y.reshape(*shape[:-1], self.out_features)

    def forward_dynamic(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            raise ValueError("a packed layer keeps no plain int8 weight")
        xq, row_scale = quantize_rows(x.float())
        # int32 * float32 promotes to float32: no separate conversion pass over the output.
        y = torch._int_mm(xq, self.qweight.t()).mul(row_scale).mul_(self.scale)
        return y if self.bias is None else y.add_(self.bias)

    kind = "int8"

    def float_rows(self) -> int:
        """From how many rows this layer multiplies in float32 (NEVER: it always uses its kernel)."""
        return self.dispatch.float_min_rows(self.in_features, self.out_features)

    def fused_operands(self) -> tuple | None:
        """(weight, scale, bias) as ip_decode_layer reads them, or None when not on the C kernel."""
        return (self.packed_weight, self.scale, self.bias) if self.is_packed else None

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.int8_linear(x.float(), self.packed_weight, self.scale, self.bias)

    def forward_weight_only(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.unit_scale)
        y = acc.float().mul_(self.scale)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def dynamic_error_bound(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """Worst-case |dynamic(x) - x @ W.T| per output, W the float weight that was quantized.

    y_ref - y = x.(W - Wq s) + (x - xq a).(Wq s); each weight is off by at most s/2 and each input
    element by at most a/2 (a = row scale), so the bound is s/2 * |x|_1 + a/2 * |Wq s|_1, plus float32
    rounding of the accumulation (tiny next to these).
    """
    x = x.float()
    _, a = quantize_rows(x)
    w_abs = layer.dequantized_weight().abs()
    bound = (layer.scale[None, :] / 2) * x.abs().sum(1, keepdim=True) + (a / 2) * w_abs.sum(1)[None, :]
    return bound * 1.001 + 1e-6


def weight_only_error_bound(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """Worst-case |weight_only(x) - x @ W.T| per output: the weight rounding s/2 * |x|_1, plus the
    bfloat16 rounding of the input (2^-9 relative per element, through |Wq s|) and of the unscaled
    output (2^-9 relative), each doubled for slack."""
    x = x.float()
    w = layer.dequantized_weight()
    eps = 2.0**-8
    weight_term = (layer.scale[None, :] / 2) * x.abs().sum(1, keepdim=True)
    input_term = eps * (x.abs() @ w.abs().t())
    output_term = eps * (x @ w.t()).abs()
    return weight_term + input_term + output_term + 1e-6
