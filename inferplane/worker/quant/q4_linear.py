"""A linear layer served from GGUF Q4_1 blocks as the file stores them: a 4-bit model stays 4-bit.

Q4_1 keeps, per output row and block of 32 inputs, a float16 scale d, a float16 minimum m and 32
four-bit values q: w = d * q + m (20 bytes per 32 weights, 0.625 bytes a weight against int8's 1).
The C kernel (native `ip_q4_1_linear`) quantizes each input row per block of 32 to int8, as
llama.cpp does for this product, and multiplies bytes; it is used below the row count where
dequantizing the weight once and running float32 GEMM measured faster at start-up (prefill). The
weights are exactly the file's, so they need no smoothing (which would change them) and lose
nothing to a second quantization; the only rounding is the input's, per block of 32.
"""

from __future__ import annotations

import torch

from inferplane.worker import native
from inferplane.worker.model.structure import WatchedModule
from inferplane.worker.quant.int8_linear import Int8Dispatch

BLOCK = native.Q4_1_BLOCK
BLOCK_BYTES = native.Q4_1_BYTES


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 32 * 20] -> float32 [N, K] (PyTorch: the reference, and the path without kernels)."""
    n, width = blocks.shape
    b = blocks.reshape(n, width // BLOCK_BYTES, BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:].to(torch.int16)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # low nibbles are inputs 0-15, high 16-31
    return (q * d + m).reshape(n, -1)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> Q4_1 blocks, as llama.cpp's quantize_row_q4_1 makes them (for tests and
    synthetic models; served models bring their file's blocks)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((w - lo) * inv).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    head = torch.cat([d.half().view(torch.uint8).reshape(n, -1, 2), lo.half().view(torch.uint8).reshape(n, -1, 2)],
                     dim=-1)
    return torch.cat([head, packed], dim=-1).reshape(n, -1).contiguous()


def scaled_q4_1(blocks: torch.Tensor, factor: float) -> torch.Tensor:
    """The same blocks with every weight times `factor` (d and m scaled; a test hook's wrong scales)."""
    n, width = blocks.shape
    b = blocks.reshape(n, width // BLOCK_BYTES, BLOCK_BYTES).clone()
    for start in (0, 2):
        half = b[..., start:start + 2].contiguous().view(torch.float16)
        b[..., start:start + 2] = (half.float() * factor).half().view(torch.uint8)
    return b.reshape(n, width)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the C kernel computes, in PyTorch: x quantized per block of 32 (scale max|x| / 127,
    round half to even), then the exact product with the dequantized weight."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    dx = xb.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv) * dx
    y = xq.reshape(m, k) @ dequantize_q4_1(blocks).T
    return y if bias is None else y + bias


class Q4Linear(WatchedModule):
    """y = x W^T + b with W held as Q4_1 blocks in the C kernel's layout (native.pack_q4_1).

    Same interface as a packed Int8Linear where the start-up measurement, the quality gate and
    the fused decode layer need one: `is_packed`, `forward_packed`, `dequantized_weight`,
    `float_rows`, `fused_operands`, `weight_bytes`."""

    kind = "q4_1"
    is_packed = True

    def __init__(self, file_blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None,
                 dispatch: Int8Dispatch | None = None):
        super().__init__()
        if in_features % BLOCK or file_blocks.shape[1] != in_features // BLOCK * BLOCK_BYTES:
            raise ValueError(f"Q4_1 blocks {tuple(file_blocks.shape)} do not hold {in_features} inputs per row")
        if not native.q4_1_shape_supported(file_blocks.shape[0], in_features):
            raise ValueError(f"Q4_1 layer {file_blocks.shape[0]}x{in_features}: needs a multiple of 16 rows")
        kernels = native.kernels()
        if kernels is None or not kernels.has_q4_1_linear:
            raise ValueError("Q4_1 layers need the C kernels (no compiler, or not x86-64 with AVX2)")
        self._kernels = kernels
        self.in_features = in_features
        self.out_features = file_blocks.shape[0]
        self.register_buffer("blocks", native.pack_q4_1(file_blocks))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.dispatch = dispatch or Int8Dispatch()

    def file_blocks(self) -> torch.Tensor:
        """The weight as the GGUF file stores it (what the start-up cache keeps)."""
        return native.unpack_q4_1(self.blocks)

    def dequantized_weight(self) -> torch.Tensor:
        return self._kernels.q4_1_dequantize(self.blocks)

    def weight_bytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def float_rows(self) -> int:
        return self.dispatch.float_min_rows(self.in_features, self.out_features, self.kind)

    def fused_operands(self) -> tuple:
        return self.blocks, None, self.bias  # no scale: ip_decode_layer reads Q4_1 blocks

    def forward_packed(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.q4_1_linear(x.float(), self.blocks, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if x2.shape[0] < self.float_rows():
            y = self.forward_packed(x2)
        else:
            y = torch.nn.functional.linear(x2, self.dequantized_weight(), self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4_1"
