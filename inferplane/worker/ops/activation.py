"""The gated MLP's activation, act(gate) * up, with SiLU (SwiGLU: Llama and most families) or GELU's
tanh approximation (GeGLU: Gemma), as one op whose kernel is chosen once per device and dtype.

Two entry points, for the two ways a model holds its MLP's first product:
- `fused(gate_up)`: one [rows, 2I] product, gate then up (a weight format that fused the two
  linears, as cpu-int8 does). The C kernel (native `silu_mul` / `gelu_mul`) reads it on float32 CPU
  rows: one pass, no chunked views;
- `__call__(gate, up)`: two products. The Triton kernel (gpu_kernels.silu_mul) serves SiLU on a CUDA
  device (or under Triton's interpreter).
PyTorch's ops run everywhere else, and wherever a call's tensors are not rows the chosen kernel reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from inferplane.worker.ops import gpu_kernels, native

Fused = Callable[[torch.Tensor], torch.Tensor]
Split = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GatedActivation:
    """act(gate) * up; `gelu` picks GELU (tanh approximation) over SiLU."""

    def __init__(self, gelu: bool):
        self.gelu = gelu
        self._fused: dict[tuple[torch.device, torch.dtype], Fused] = {}  # chosen by (device, dtype)
        self._split: dict[tuple[torch.device, torch.dtype], Split] = {}

    def fused(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gate | up) -> [..., I]."""
        kernel = self._fused.get((gate_up.device, gate_up.dtype)) or self._choose_fused(gate_up)
        return kernel(gate_up)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        kernel = self._split.get((gate.device, gate.dtype)) or self._choose_split(gate)
        return kernel(gate, up)

    def _choose_fused(self, gate_up: torch.Tensor) -> Fused:
        kernels = native.kernels() if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 else None
        kernel = _c_fused(kernels, self.gelu) if kernels is not None else _torch_fused(self.gelu)
        self._fused[(gate_up.device, gate_up.dtype)] = kernel
        return kernel

    def _choose_split(self, gate: torch.Tensor) -> Split:
        triton = not self.gelu and gpu_kernels.runs_on(gate.device, gate.dtype)
        kernel = _triton_silu_mul if triton else _torch_split(self.gelu)
        self._split[(gate.device, gate.dtype)] = kernel
        return kernel


def gated(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """PyTorch's act(gate) * up: what every kernel here computes."""
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def _torch_fused(gelu: bool) -> Fused:
    def kernel(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gated(gate, up, gelu)

    return kernel


def _torch_split(gelu: bool) -> Split:
    return lambda gate, up: gated(gate, up, gelu)


def _c_fused(kernels: native.NativeKernels, gelu: bool) -> Fused:
    otherwise = _torch_fused(gelu)

    def kernel(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.is_contiguous():
            return kernels.gelu_mul(gate_up) if gelu else kernels.silu_mul(gate_up)
        return otherwise(gate_up)

    return kernel


def _triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gpu_kernels.serves(gate, up) and gate.dtype == up.dtype:
        return gpu_kernels.silu_mul(gate, up)
    return gated(gate, up, False)
