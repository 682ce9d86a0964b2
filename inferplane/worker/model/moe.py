"""A Mixture-of-Experts MLP (Mixtral, Qwen3-MoE) in place of the Llama block's dense MLP.

A router scores every expert per token; the top `experts_per_token` are kept, their softmax
probabilities renormalised to sum to 1 where the model says so (Mixtral always; Qwen3-MoE by
`norm_topk_prob`), and the token's output is the weighted sum of those experts' gated MLPs.

Experts run grouped: tokens are sorted by the expert they were routed to, and each expert that
received any runs once over all its rows (one matmul per expert per step, never a loop per token).
Each expert is the dense `MLP` module, so cpu-int8 quantizes and packs experts as it does any linear,
and the fused CPU decode (ops/fused_decode.py, native moe_mlp) runs the same steps in C.
"""

from __future__ import annotations

import torch
from torch import nn

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.layers import MLP
from inferplane.worker.ops.router import ExpertRouter
from inferplane.worker.ops.structure import WatchedModule


class SparseMoE(WatchedModule):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router's scores (HF's name)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.router = ExpertRouter(self.top_k, self.normalize)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) for each token (ops/router.py: on float32
        CPU rows, the C kernels the fused decode routes with). cpu-int8 keeps the router in float32:
        it is tiny, and routing is where quantization hurts."""
        return self.router(x, self.gate)

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
