"""The Llama family (Llama, SmolLM2, Mistral, Qwen2) in plain PyTorch, gpt-fast style.

Tokens of all sequences in a step are flattened into one [T] axis, so every linear layer runs
as one matmul over the whole batch; only attention looks at sequence boundaries (attention.py).
Module and parameter names follow HF's so a safetensors state dict loads as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from inferplane.worker.attention import AttentionBatch, PagedKVCache, paged_attention, store_kv
from inferplane.worker.model.config import ModelConfig, ModelLoadError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, indexed per token."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        # A weight format may replace q/k/v_proj by one fused layer (quant/convert.py): one matmul, not three.
        self.qkv_proj: nn.Module | None = None
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: PagedKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = cache.layer(self.layer_index)
        store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, batch, self.scale)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj: nn.Module | None = None  # fused gate and up, like Attention.qkv_proj
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, rotary, cache, batch):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config, max_positions or config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; logits are computed only for sampled rows."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.rotary, cache, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
