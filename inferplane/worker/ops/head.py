"""The output head's kernel: which one turns a causal LM's final hidden rows into logits, chosen by
measurement at start-up, and the head's operands where the fused decode's C call runs it.

Why a choice: the head is the biggest weight, and the rows sampled per step are few. For a float32
head (an nn.Linear) on the CPU, the C kernel (native `f32_linear`) reads the tall weight in place:
2.2x PyTorch's speed for one row of SmolLM2's head on AVX-512; but PyTorch's GEMM wins from some
row count on, which differs from CPU to CPU, so `measure` times both at start-up and the kernel runs
below the crossover only. A quantized head (quant/) chooses its own kernel by rows (its dispatch's
`float_rows`); everywhere else (a GPU, another dtype) the head runs as it is, in PyTorch.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.worker.ops import native, structure
from inferplane.worker.ops.fused_decode import linear_operands
from inferplane.worker.ops.native.choice import NEVER, crossover


class HeadKernel:
    """Which kernel runs a model's head, for the rows of each call; one per model."""

    def __init__(self):
        self.torch_from_rows = NEVER  # set by measure: PyTorch's GEMM from this many rows on
        self._fused: tuple = (None, None, None)  # (what fused_operands' answer depends on, it, what is held)

    def logits(self, head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """head(hidden) as float32 logits [rows, vocab], on the kernel chosen for that many rows."""
        if type(head) is nn.Linear and hidden.device.type == "cpu":
            kernels = self._float_kernel(head, hidden.shape[0]) if hidden.dtype == torch.float32 else None
            if kernels is not None:
                return kernels.f32_linear(hidden, head.weight, head.bias)
            return _torch_logits(head, hidden)
        return head(hidden).float()

    def fused_operands(self, head: nn.Module, rows: int) -> tuple | None:
        """The head's operands (linear_operands' shape) for the fused decode's C call, where `logits`
        would run that same C kernel on `rows` rows; None otherwise: the head then runs after the
        call. The same tuple while nothing it depends on changes (the fused decode then reuses what
        it made of it): worked out each step, it was 20 us of a batch-1 decode step run with caches
        the weights had swept."""
        dispatch = getattr(head, "dispatch", None)
        held = (head, getattr(head, "weight", None), getattr(head, "bias", None), native.kernels())
        # by identity (the objects are held with the answer, so no id is reused while it is kept)
        key = (rows, *map(id, held), self.torch_from_rows, None if dispatch is None else dispatch.version,
               structure.version())
        if self._fused[0] != key:
            self._fused = (key, self._operands(head, rows), held)
        return self._fused[1]

    def _operands(self, head: nn.Module, rows: int) -> tuple | None:
        if type(head) is nn.Linear:  # float32: logits' C kernel below its measured crossover
            if self._float_kernel(head, rows) is None:
                return None
            return head.weight, None, native.FLOAT32_BITS, head.bias, head.out_features
        if not hasattr(head, "float_rows") or rows >= head.float_rows():  # below it: head() runs its C kernel
            return None
        return linear_operands(head)

    def _float_kernel(self, head: nn.Linear, rows: int) -> native.NativeKernels | None:
        """The C kernel that runs a float32 head for `rows` float32 CPU rows: below the crossover
        measured at start-up and where it reads the weight; None: PyTorch's product. The one rule
        for `logits` and for the fused decode's call (`fused_operands`)."""
        kernels = native.kernels()
        if kernels is None or rows >= self.torch_from_rows or not kernels.f32_weight_applies(head.weight):
            return None
        return kernels

    def measure(self, head: nn.Module, max_rows: int = 16) -> int:
        """Times the C head kernel against PyTorch's product on this CPU and keeps the kernel below
        the measured crossover; returns it (NEVER: the kernel won throughout, or does not apply)."""
        kernels = native.kernels()
        self.torch_from_rows = NEVER
        if type(head) is not nn.Linear or head.weight.device.type != "cpu" or kernels is None:
            return NEVER
        probe = torch.zeros(1, head.in_features, dtype=head.weight.dtype)
        if not kernels.f32_linear_applies(probe, head.weight):
            return NEVER
        rows = [r for r in (1, 2, 4, 8, 16, 32) if r <= max_rows]
        self.torch_from_rows = crossover(lambda x: kernels.f32_linear(x, head.weight, head.bias),
                                         lambda x: _torch_logits(head, x),
                                         lambda n: torch.randn(n, head.in_features), rows)
        return self.torch_from_rows


def _torch_logits(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    if head.bias is None and hidden.shape[0] > 1:
        # [V, H] @ [H, M] rather than [M, H] @ [H, V]: the same product, but the CPU's GEMM
        # blocks the tall weight better (16 rows of SmolLM2's head: 14.7 against 20.3 ms).
        return torch.mm(head.weight, hidden.t()).t().float()
    return head(hidden).float()
