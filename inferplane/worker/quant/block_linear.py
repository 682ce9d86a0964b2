"""A linear layer served from a GGUF file's 4-, 5-, 6- or 8-bit blocks as the file stores them: a
4-bit model stays 4-bit.

Per output row and block of 32 inputs: a float16 scale d, a float16 minimum m and 32 values q of
4 or 5 bits, w = d * q + m (gguf_blocks.py turns Q4_0/Q4_1/Q4_K and Q5_0/Q5_1/Q5_K into that), or
Q6_K's 6-bit values with a scale per half-block, or Q8_0's (values + 128, m = -128 d, d alone
stored): 0.625, 0.75, 0.875 or 1.0625 bytes a weight against per-channel int8's 1. The C kernel
(native `ip_block_linear`) quantizes each input row per block of 32 to int8, as llama.cpp does for
this product, and multiplies bytes; it is used below the row count where dequantizing the weight
once and running float32 GEMM measured faster at start-up (prefill). The weights are the file's,
so they need no smoothing (which would change them) and lose nothing to a second quantization; the
only rounding is the input's, per block of 32.
"""

from __future__ import annotations

import torch

from inferplane.worker.ops import native
from inferplane.worker.ops.structure import WatchedModule
from inferplane.worker.quant.gguf_blocks import Blocks
from inferplane.worker.quant.int8_linear import Int8Dispatch

BLOCK = native.BLOCK


def quantize_blocks(weight: torch.Tensor, bits: int = 4) -> Blocks:
    """float [N, K] -> blocks of `bits`, as llama.cpp's quantize_row_q4_1 / q5_1 / q8_0 make them,
    or for 6 bits Q6_K's form with a plain absmax rule (for tests and synthetic models; served models
    bring their file's blocks)."""
    n, k = weight.shape
    if bits == 6:
        return _quantize_q6(weight.float())
    if bits == 8:
        return _quantize_q8_0(weight.float())
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    top = (1 << bits) - 1
    d = (hi - lo) / top
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((w - lo) * inv).round().clamp(0, top).to(torch.uint8)
    return Blocks(q.reshape(n, k), d.squeeze(-1).half(), lo.squeeze(-1).half(), bits)


def _quantize_q8_0(weight: torch.Tensor) -> Blocks:
    """Q8_0: d = max|w| / 127 per block, q = round(w / d), stored as q + 128 with m = -128 d."""
    n, k = weight.shape
    w = weight.reshape(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(dim=-1, keepdim=True) / 127).half()
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (w * inv).round().clamp(-127, 127).to(torch.int16) - native.Q8_MIN
    return Blocks(q.to(torch.uint8).reshape(n, k), d.squeeze(-1), (d.squeeze(-1).float() * native.Q8_MIN).half(), 8)


def _quantize_q6(weight: torch.Tensor) -> Blocks:
    """w ~ d * sc * (q - 32): per half-block sc * d = max|w| / 31, d per block of 32 = the larger of
    its halves' / 127."""
    n, k = weight.shape
    halves = weight.reshape(n, k // 16, 16)
    step = halves.abs().amax(dim=-1) / 31  # [n, k / 16]
    d = (step.reshape(n, k // BLOCK, 2).amax(dim=-1) / 127).half()
    d_float = d.float().repeat_interleave(2, dim=1)
    sc = torch.where(d_float > 0, (step / d_float).round(), torch.zeros_like(step)).clamp(-127, 127)
    dsc = (d_float * sc).unsqueeze(-1)
    inv = torch.where(dsc > 0, 1 / dsc, torch.zeros_like(dsc))
    q = (halves * inv).round().add(32).clamp(0, 63).to(torch.uint8)
    return Blocks(q.reshape(n, k), d, sc.to(torch.int8), 6)


def reference_linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """What the C kernel computes, in PyTorch: x quantized per block of 32 (scale max|x| / 127,
    round half to even), then the exact product with the dequantized weight."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    dx = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv) * dx
    y = xq.reshape(m, k) @ blocks.dequantized().T
    return y if bias is None else y + bias


class BlockLinear(WatchedModule):
    """y = x W^T + b with W held as blocks of 4, 5, 6 or 8 bits in the C kernel's layout (native.pack_blocks).

    Same interface as a packed Int8Linear where the start-up measurement, the quality gate and
    the fused decode layer need one: `is_packed`, `forward_packed`, `dequantized_weight`,
    `float_rows`, `fused_operands`, `weight_bytes`."""

    is_packed = True

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None, dispatch: Int8Dispatch | None = None):
        super().__init__()
        out_features, in_features = blocks.values.shape
        if not native.block_shape_supported(out_features, in_features):
            raise ValueError(f"block layer {out_features}x{in_features}: needs a multiple of 16 rows and of "
                             f"{BLOCK} inputs")
        kernels = native.kernels()
        if kernels is None or not kernels.has_block_linear:
            raise ValueError("block layers need the C kernels (no compiler, or not x86-64 with AVX2)")
        self._kernels = kernels
        self.in_features = in_features
        self.out_features = out_features
        self.bits = blocks.bits
        self.kind = native.BLOCK_KINDS[blocks.bits]  # the dispatch's and the stats' name for it
        self.register_buffer("blocks", native.pack_blocks(blocks.values, blocks.d, blocks.m, blocks.bits))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.dispatch = dispatch or Int8Dispatch()

    def file_blocks(self) -> Blocks:
        """The weight as blocks of 32, the file's values (what the start-up cache keeps)."""
        return Blocks(*native.unpack_blocks(self.blocks, self.bits), self.bits)

    def dequantized_weight(self) -> torch.Tensor:
        return self._kernels.block_dequantize(self.blocks, self.bits)

    def weight_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def float_rows(self) -> int:
        return self.dispatch.float_min_rows(self.in_features, self.out_features, self.kind)

    def fused_operands(self) -> tuple:
        return self.blocks, None, self.bias  # no scale: ip_decode_layers reads blocks of self.bits

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.block_linear(x.float(), self.blocks, self.bits, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if x2.shape[0] < self.float_rows():
            y = self.forward_packed(x2)
        else:
            y = torch.nn.functional.linear(x2, self.dequantized_weight(), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"
