"""The architecture numbers the engine needs, from a HF config.json or from GGUF metadata (read
without torch, so the registry reads a model's numbers by the workers' own rule: read_model_config).

One `ModelConfig` describes every decoder family served (api/architectures.py lists them): the
Llama block is the default, and each family is a handful of fields that say how it differs
(query/key norms, Gemma's sandwich norms and embedding scale, sliding-window layers, soft-capping,
a Mixture-of-Experts MLP, Phi-3's LongRoPE), so the modules read a field, not a family name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferplane.api.architectures import ARCHITECTURE_KINDS, canonical_architecture, unsupported_message

# The decoder families this module describes (embedding models have their own loader).
SUPPORTED_ARCHITECTURES = tuple(name for name, kind in ARCHITECTURE_KINDS.items() if kind == "generate")

FULL, SLIDING = "full_attention", "sliding_attention"


def gguf_value(reader, key: str, default=None):
    """A GGUF metadata value, or `default` when the key is absent (kept torch-free for the gateway)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


class ModelLoadError(Exception):
    """A model cannot be loaded; the message is one line a user can act on."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # --- how a family differs from the Llama block ---
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP, before the residual add
    embedding_multiplier: float | None = None  # Gemma: embeddings scaled by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma) instead of head_dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    sliding_window: int | None = None  # a sliding layer's query sees keys less than this many positions back
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; empty: every layer FULL
    rope_local_theta: float | None = None  # rotary base of sliding layers when it differs (Gemma 3)
    # Mixture of Experts (Mixtral, Qwen3-MoE); num_experts 0: a dense MLP everywhere
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    normalize_expert_weights: bool = True  # renormalise the top-k router probabilities to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP in a MoE model

    def layer_type(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else FULL

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index` (None: the whole context)."""
        return self.sliding_window if self.layer_type(index) == SLIDING else None

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index not in self.dense_layers

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def fused_decode_block(self) -> bool:
        """True when every layer is a block the fused CPU decode computes: the Llama block, with
        Gemma's and Qwen3's differences (GeGLU, query/key norms, the sandwich of norms, sliding
        layers with their own rope, Gemma 2's soft-capped scores), Mixture-of-Experts MLPs and
        LongRoPE (its tables are per position, as every rope's are)."""
        return self.hidden_act in ("silu", "gelu_tanh")

    @property
    def rope_scaling_per_position(self) -> bool:
        """LongRoPE (Phi-3) rotates positions past the original context with other frequencies."""
        return bool(self.rope_scaling) and self.rope_scaling.get("rope_type") == "longrope"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4.x or 5.x spelling)."""
        raw_type = str(cfg.get("model_type", ""))
        arch = canonical_architecture(raw_type)
        if arch is None or arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(unsupported_message(raw_type))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        num_layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_params = cfg.get("rope_parameters") or {}
        local_theta = None
        if "full_attention" in rope_params:  # Gemma 3: one rope per layer type
            local_theta = float((rope_params.get("sliding_attention") or {}).get("rope_theta", 10000.0))
            rope_params = rope_params.get("full_attention") or {}
        if arch == "gemma3" and local_theta is None:
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if partial != 1.0:
            raise ModelLoadError(f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)")
        if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
            scaling = dict(scaling, rope_type="longrope")
            scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        gemma = arch in ("gemma2", "gemma3")
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window they do not use
        layer_types = tuple(cfg.get("layer_types") or ())
        if window and not layer_types:
            layer_types = (SLIDING,) * num_layers  # Mistral, Phi-3: every layer slides
        if not window:
            layer_types = ()
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        dense: tuple[int, ...] = ()
        if experts:
            step = int(cfg.get("decoder_sparse_step") or 1)
            only_mlp = set(cfg.get("mlp_only_layers") or ())
            dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step != 0)
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=_activation(act),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            sandwich_norms=gemma,
            embedding_multiplier=hidden**0.5 if gemma else None,
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma and cfg.get("query_pre_attn_scalar")
            else None,
            attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
            normalize_expert_weights=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=dense,
        )


def _optional_float(value: Any) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def _activation(name: str) -> str:
    if name in ("silu", "swish"):
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return "gelu_tanh"
    raise ModelLoadError(f"activation {name!r} is not supported (supported: silu, gelu_pytorch_tanh)")


# llama.cpp's per-family facts a GGUF file does not carry: every how-many-th layer attends globally
# (the rest slide), and the sliding layers' rope base.
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_LOCAL_ROPE_BASE = {"gemma3": 10000.0}


def config_from_gguf(reader) -> ModelConfig:
    file_arch = gguf_value(reader, "general.architecture")
    arch = canonical_architecture(file_arch)
    if arch is None or arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF file: {unsupported_message(file_arch)}")
    p = f"{file_arch}."
    heads = int(gguf_value(reader, p + "attention.head_count"))
    hidden = int(gguf_value(reader, p + "embedding_length"))
    layers = int(gguf_value(reader, p + "block_count"))
    vocab = gguf_value(reader, p + "vocab_size")
    if vocab is None:  # the token list's length, read without its strings
        vocab = reader.fields["tokenizer.ggml.tokens"].length
        if vocab is None:
            raise ModelLoadError("GGUF file: tokenizer.ggml.tokens is not an array")
    names = {t.name for t in reader.tensors}
    scaling = None
    scaling_type = gguf_value(reader, p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        scaling = {"rope_type": scaling_type, "factor": float(gguf_value(reader, p + "rope.scaling.factor", 1.0))}
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id")
    head_dim = int(gguf_value(reader, p + "attention.key_length", hidden // heads))
    experts = int(gguf_value(reader, p + "expert_count", 0) or 0)
    if arch == "llama" and experts:
        arch = "mixtral"
    window = gguf_value(reader, p + "attention.sliding_window")
    pattern = _SLIDING_PATTERN.get(arch)
    layer_types: tuple[str, ...] = ()
    if window and pattern:
        layer_types = tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    elif window:
        layer_types = (SLIDING,) * layers
    gemma = arch in ("gemma2", "gemma3")
    pre_attn_scalar = None
    if gemma:  # llama.cpp's rule: the 27B models scale by hidden / heads, the others by head_dim
        pre_attn_scalar = float(hidden // heads if layers in (46, 62) else head_dim)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf_value(reader, p + "feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(gguf_value(reader, p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(gguf_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_value(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(gguf_value(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        hidden_act="gelu_tanh" if gemma else "silu",
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sandwich_norms=gemma,
        embedding_multiplier=hidden**0.5 if gemma else None,
        query_pre_attn_scalar=pre_attn_scalar,
        attn_logit_softcap=_positive(gguf_value(reader, p + "attn_logit_softcapping")),
        final_logit_softcap=_positive(gguf_value(reader, p + "final_logit_softcapping")),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        rope_local_theta=_LOCAL_ROPE_BASE.get(arch),
        num_experts=experts,
        experts_per_token=int(gguf_value(reader, p + "expert_used_count", 0) or 0),
        moe_intermediate_size=int(gguf_value(reader, p + "expert_feed_forward_length", 0)
                                  or gguf_value(reader, p + "feed_forward_length")),
        normalize_expert_weights=bool(gguf_value(reader, p + "expert_weights_norm", True)),
    )


def _positive(value) -> float | None:
    return float(value) if value else None


def read_model_config(path) -> ModelConfig:
    """A model's config from its files: a GGUF file's header or a HF folder's config.json (the
    registry's view of a base model; the worker's loader reads the same way). ModelLoadError naming
    the path where neither can be read."""
    import json
    from pathlib import Path

    from inferplane.api.gguf_reader import open_gguf

    path = Path(path)
    try:
        if path.is_file():
            return config_from_gguf(open_gguf(path))
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:  # TypeError: a key missing or of a wrong type
        raise ModelLoadError(f"cannot read the model config of {path}: {exc}") from None
