"""Gemma 2 and Gemma 3: the Llama block with a sandwich of norms.

What differs from the Llama block here: the attention output is normed before the residual add
(`post_attention_layernorm`, which in Llama is the MLP's input norm), the MLP has its own input
norm (`pre_feedforward_layernorm`) and its output is normed too (`post_feedforward_layernorm`).
Everything else Gemma does is a field of ModelConfig the shared modules read: GeGLU
(`hidden_act`), the embedding scale, query/key norms (Gemma 3), sliding layers, soft-capping
(Gemma 2), the attention scale from `query_pre_attn_scalar`.

Gemma's RMSNorm multiplies by (1 + weight). The loader adds the 1 to the weights once (GGUF files
already store it so), so every norm here is the plain RMSNorm and its C kernel.
"""

from __future__ import annotations

import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.decoder import DecoderLayer
from inferplane.worker.ops.norm import RMSNorm


class SandwichDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mlp_input_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm

    def forward(self, x, rope_tables, cache, batch) -> torch.Tensor:
        attended = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope_tables, cache, batch))
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, attended)
        return x + self.post_feedforward_layernorm(self.mlp(h))


# Norm weights Gemma stores as w where the computation multiplies by (1 + w) (HF checkpoints; GGUF
# files store 1 + w already).
GEMMA_NORM_SUFFIXES = ("norm.weight",)


def gemma_norm_weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Gemma HF checkpoint's norm weight w as the plain RMSNorm's weight 1 + w (others unchanged)."""
    return tensor + 1.0 if name.endswith(GEMMA_NORM_SUFFIXES) else tensor
