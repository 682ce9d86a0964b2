"""A Mixture-of-Experts MLP (Mixtral, Qwen3-MoE) in place of the Llama block's dense MLP.

A router scores every expert per token; the top `experts_per_token` are kept, their softmax
probabilities renormalised to sum to 1 where the model says so (Mixtral always; Qwen3-MoE by
`norm_topk_prob`), and the token's output is the weighted sum of those experts' gated MLPs.

Experts run grouped: tokens are sorted by the expert they were routed to, and each expert that
received any runs once over all its rows (one matmul per expert per step, never a loop per token).
Each expert is the dense `MLP` module, so cpu-int8 quantizes and packs experts as it does any linear,
and the fused CPU decode (fused_decode.py, native moe_mlp) runs the same steps in C.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.layers import MLP
from inferplane.worker.model.structure import WatchedModule
from inferplane.worker.ops import native


class SparseMoE(WatchedModule):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) for each token. Float32 rows on the CPU
        are scored and routed by the C kernels the fused decode uses (the same bits either way).
        cpu-int8 keeps the router in float32: it is tiny, and routing is where quantization hurts."""
        kernels = native.kernels()
        on_kernels = kernels is not None and x.dim() == 2 and native.float32_rows(x)
        if on_kernels and type(self.gate) is nn.Linear and kernels.f32_linear_applies(x, self.gate.weight):
            logits = kernels.f32_linear(x, self.gate.weight, self.gate.bias)  # the fused decode's router product
        else:
            logits = self.gate(x)
        if on_kernels and native.float32_rows(logits):
            return kernels.moe_route(logits, self.top_k, self.normalize)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            rows = tokens[start:start + count]
            start += count
            y = self.experts[expert](x[rows]) * weights.reshape(-1)[pairs, None]
            out.index_add_(0, rows, y)
        return out
