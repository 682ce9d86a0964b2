"""A Mixture-of-Experts router's choice: each token's `top_k` experts and their weights, from the
softmax of the router's scores (renormalised to sum to 1 where the model says so).

On float32 CPU rows the C kernels score (native `f32_linear`, where the router is a plain float32
linear they read) and route (`moe_route`): the kernels the fused decode (fused_decode.py) runs for a
MoE layer, so a step computes the same bits whether its layers ran fused or op by op. Elsewhere
PyTorch's ops do both. The kernels are chosen once per device and dtype of the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from inferplane.worker.ops import native

Route = Callable[[torch.Tensor, nn.Module], tuple[torch.Tensor, torch.Tensor]]


class ExpertRouter:
    """(weights [T, k] in x's dtype, expert ids [T, k]) of each token's `top_k` experts."""

    def __init__(self, top_k: int, normalize: bool):
        self.top_k, self.normalize = top_k, normalize
        self._routes: dict[tuple[torch.device, torch.dtype], Route] = {}  # chosen by (device, dtype) of x

    def __call__(self, x: torch.Tensor, gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]; `gate`: the router's linear (float32 under cpu-int8: it is tiny, and routing
        is where quantization hurts)."""
        route = self._routes.get((x.device, x.dtype)) or self._choose(x)
        return route(x, gate)

    def _choose(self, x: torch.Tensor) -> Route:
        kernels = native.kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
        route = self._torch if kernels is None else self._c_route(kernels)
        self._routes[(x.device, x.dtype)] = route
        return route

    def _torch(self, x: torch.Tensor, gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return self._torch_route(gate(x), x.dtype)

    def _torch_route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(dtype), ids

    def _c_route(self, kernels: native.NativeKernels) -> Route:
        def route(x: torch.Tensor, gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
            if not (x.dim() == 2 and x.is_contiguous()):
                return self._torch(x, gate)
            if type(gate) is nn.Linear and kernels.f32_weight_applies(gate.weight):
                logits = kernels.f32_linear(x, gate.weight, gate.bias)  # the fused decode's router product
            else:
                logits = gate(x)
            if native.float32_rows(logits):
                return kernels.moe_route(logits, self.top_k, self.normalize)
            return self._torch_route(logits, x.dtype)

        return route
