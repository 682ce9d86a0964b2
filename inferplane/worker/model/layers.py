"""The parts of the Llama block in plain PyTorch, gpt-fast style: rotary embedding tables (with the
config's scaling: linear, Llama 3, YaRN, LongRoPE), attention over the paged cache and the gated MLP.
decoder.py puts them together as the block; the families' differences (gemma.py, moe.py) are built
from them too. Module and parameter names follow HF's so a safetensors state dict loads as it is.

Where a step has a kernel, these call an op of the ops wing (inferplane/worker/ops/): RMSNorm
(ops/norm.py), the rotation with the KV write (ops/rope.py), attention (ops/attention.py) and the
gated activation (ops/activation.py). Each op chose its backend (C, Triton or PyTorch) itself, once
per device and dtype: nothing here names a backend.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inferplane.api.model_config import ModelConfig, ModelLoadError
from inferplane.worker.ops.activation import GatedActivation
from inferplane.worker.ops.attention import AttentionBatch, PagedAttention
from inferplane.worker.ops.kv_cache import PagedKVCache
from inferplane.worker.ops.norm import RMSNorm
from inferplane.worker.ops.rope import RotaryKVWrite
from inferplane.worker.ops.structure import WatchedModule


def rope_inv_freq(config: ModelConfig, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Rotary inverse frequencies for `theta` (default: the config's) with the config's scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / ((theta or config.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling if scaled else None
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
    if kind == "longrope":  # Phi-3: the short factors (positions within the original context)
        return (inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    raise ModelLoadError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)")


def _longrope_tables(config: ModelConfig, theta: float, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3's LongRoPE: positions within the original context rotate with the short factors, later
    ones with the long factors (as transformers does for a sequence that grew past it), and both
    tables are scaled by the attention factor. Returns (cos, sin) without the sign."""
    scaling = config.rope_scaling
    original = int(scaling["original_max_position_embeddings"])
    dim = config.head_dim
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    short = (base / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    long = (base / torch.tensor(scaling["long_factor"], dtype=torch.float64)).float()
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    freqs = torch.where((t < original)[:, None], torch.outer(t, short), torch.outer(t, long))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context length, looked up once per forward pass
    (every layer of one rope kind rotates the same positions). `theta` and `scaled` pick the sliding
    layers' own rope where a family has one (Gemma 3: base 10,000 and no scaling)."""

    def __init__(self, config: ModelConfig, max_positions: int, theta: float | None = None, scaled: bool = True):
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        half = config.head_dim // 2
        if scaled and config.rope_scaling_per_position:
            cos, sin = _longrope_tables(config, theta or config.rope_theta, t)
        else:
            freqs = torch.outer(t, rope_inv_freq(config, theta, scaled))
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
        # rotate_half(x) = [-x2, x1] = roll(x, half) * [-1.., +1..]: the sign lives in the sin table,
        # so a rotation is one roll and a fused multiply-add (ops/rope.py).
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin * sign, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions → cos and signed sin, each [T, 1, head_dim]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class Attention(WatchedModule):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        # A weight format may replace q/k/v_proj by one fused layer (quant/convert.py): one matmul, not three.
        self.qkv_proj: nn.Module | None = None
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer_index)  # None: the whole context
        self.softcap = config.attn_logit_softcap
        # Query/key norms (Qwen3, Gemma 3) come before the rotation, so the C path that rotates and
        # stores in one pass does not apply to them.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)
        self.rotate_and_store = RotaryKVWrite(config.num_heads, config.num_kv_heads, hd)
        self.attend = PagedAttention(self.scale, window=self.window, softcap=self.softcap)

    def _head_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None:
            return q, k
        hd = self.head_dim
        # as [rows, head_dim] the norm takes the C kernel where it applies
        return (self.q_norm(q.reshape(-1, hd)).view(q.shape), self.k_norm(k.reshape(-1, hd)).view(k.shape))

    def forward(self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor], cache: PagedKVCache,
                batch: AttentionBatch) -> torch.Tensor:
        t, heads, kv_heads, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = cache.layer(self.layer_index)
        if cache.is_windowed(self.layer_index):  # this layer's KV is in the window pool: its own slots and tables
            batch = batch.window
        if self.qkv_proj is None:
            q, k = self._head_norms(self.q_proj(x).view(t, heads, hd), self.k_proj(x).view(t, kv_heads, hd))
            v = self.v_proj(x).view(t, kv_heads, hd)
            q, k = self.rotate_and_store(q, k, v, *rope_tables, batch.slot_mapping, k_cache, v_cache)
        else:
            qkv = self.qkv_proj(x).view(t, heads + 2 * kv_heads, hd)  # q and k adjacent: one rotation for both
            if self.q_norm is not None:  # normed in place, before the rotation (as the fused decode does)
                qkv[:, :heads], qkv[:, heads : heads + kv_heads] = self._head_norms(qkv[:, :heads],
                                                                                 qkv[:, heads : heads + kv_heads])
            q, k, v = self.rotate_and_store.fused(qkv, *rope_tables, batch.slot_mapping, k_cache, v_cache)
        return self.o_proj(self.attend(q, k, v, k_cache, v_cache, batch).reshape(t, -1))


class MLP(WatchedModule):
    """Gated MLP: SwiGLU (Llama) or GeGLU with tanh GELU (Gemma), as config.hidden_act says."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj: nn.Module | None = None  # fused gate and up, like Attention.qkv_proj
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.act = GatedActivation(gelu=config.hidden_act == "gelu_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(self.act.fused(self.gate_up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
