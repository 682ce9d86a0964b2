"""RMSNorm, with the residual add before it, as one op whose kernel is chosen once per device and
dtype of its input.

Kernels, in the order they are tried where a norm first meets a device and dtype:
- C (native `rms_norm`): float32 on the CPU, where the kernels built; one pass per row, the residual
  add included (it runs where the decoder layer adds its attention output, then norms for the MLP);
- Triton (gpu_kernels.rms_norm): the tensors' dtype on a CUDA device, or any device under Triton's
  interpreter: one kernel where PyTorch's ops launch eight;
- PyTorch's ops, anywhere.
The choice holds for every later call with that device and dtype; a call checks only what can differ
between such calls (x's rows are 2-D and contiguous, delta's match) and runs PyTorch's ops where the
kernel would not read them. Every kernel rounds where PyTorch's ops round (gpu_kernels.py says how),
so the choice changes the speed, not the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from inferplane.worker.ops import gpu_kernels, native
from inferplane.worker.ops.structure import WatchedModule


class _Kernel(NamedTuple):
    """One backend's norm, and its add-and-norm: the norm of x + delta, x updated in place to the
    sum, or None where it does not read these tensors (the caller then adds and norms)."""

    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_and_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor | None]


class RMSNorm(WatchedModule):
    """x / rms(x) * weight over the last axis, the rms taken in float32 (HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._kernels: dict[tuple[torch.device, torch.dtype], _Kernel] = {}  # chosen by (device, dtype) of x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._kernels.get((x.device, x.dtype)) or self._choose(x)
        return kernel.norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm, one pass on the CPU and on the
        GPU. Updates x in place there; x is the layer's own running sum, which nothing else reads."""
        kernel = self._kernels.get((x.device, x.dtype)) or self._choose(x)
        normed = kernel.add_and_norm(x, delta, self.weight, self.eps)
        if normed is None:
            x = x + delta
            return x, self(x)
        return x, normed

    def _choose(self, x: torch.Tensor) -> _Kernel:
        weight = self.weight
        kernels = native.kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        if kernels is not None and native.float32_rows(weight):
            kernel = _c_kernel(kernels)
        elif gpu_kernels.runs_on(x.device, x.dtype) and x.dtype == weight.dtype and gpu_kernels.serves(weight):
            kernel = _TRITON
        else:
            kernel = _TORCH
        self._kernels[(x.device, x.dtype)] = kernel
        return kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch's RMSNorm: x in float32, times rsqrt(mean(x^2) + eps), rounded to x's dtype, times
    the weight. What every kernel here computes."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _c_kernel(kernels: native.NativeKernels) -> _Kernel:
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():
            return kernels.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_and_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        if x.dim() == 2 and x.is_contiguous() and native.float32_rows(delta):
            return kernels.rms_norm(x, weight, eps, delta=delta)
        return None

    return _Kernel(norm, add_and_norm)


def _triton_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.is_contiguous():
        return gpu_kernels.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def _triton_add_and_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> torch.Tensor | None:
    if x.dim() == 2 and x.is_contiguous() and delta.dtype == x.dtype and gpu_kernels.serves(delta):
        return gpu_kernels.rms_norm(x, weight, eps, delta=delta)
    return None


_TRITON = _Kernel(_triton_norm, _triton_add_and_norm)
_TORCH = _Kernel(rms_norm, lambda x, delta, weight, eps: None)
