"""The Llama decoder layer: attention and MLP (or a Mixtral-style MoE, moe.py), each after an RMSNorm,
each added to the residual. Gemma's sandwich of norms (gemma.py) is this layer with more norms.
"""

from __future__ import annotations

from inferplane.api.model_config import FULL, SLIDING, ModelConfig
from inferplane.worker.model.layers import MLP, Attention
from inferplane.worker.model.moe import SparseMoE
from inferplane.worker.ops.norm import RMSNorm
from inferplane.worker.ops.structure import WatchedModule


class DecoderLayer(WatchedModule):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        if config.is_moe_layer(layer_index):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # which rope table the layer's attention rotates with (Gemma 3's sliding layers have their own)
        self.rope_kind = SLIDING if config.rope_local_theta and config.layer_type(layer_index) == SLIDING else FULL

    @property
    def mlp_input_norm(self) -> RMSNorm:
        """The norm whose output the MLP reads (quantization's smoothing folds scales into it)."""
        return self.post_attention_layernorm

    def forward(self, x, rope_tables, cache, batch):
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), rope_tables, cache, batch))
        return x + self.mlp(h)
