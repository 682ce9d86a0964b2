"""A BERT encoder in plain PyTorch, with Hugging Face's parameter names.

The modules are named as `transformers.BertModel` names them (embeddings.word_embeddings,
encoder.layer.N.attention.self.query, ...), so a checkpoint's state dict loads as it is, with no
renaming table to keep in step. What BERT is, as served here: learned absolute position
embeddings, token type 0 for every token (one segment: embedding inputs are single texts),
post-LayerNorm blocks (the residual is added, then normalized) and a GELU feed-forward. The pooler
and any pre-training heads a checkpoint carries are not loaded: sentence embeddings pool the last
hidden states (worker/embedding/pooling.py).

Padding is the caller's: inputs of different lengths go in one forward, padded, with a mask that
keeps every token from attending to padding (the padded rows' own outputs are garbage, and
pooling ignores them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inferplane.api.model_config import ModelLoadError
from inferplane.worker.model.hf_folder import read_config, read_safetensors

# HF's names for the activations BERT checkpoints use.
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint entries that are not encoder weights: position ids (a buffer older exports saved), the
# pooler (sentence embeddings do not use it) and pre-training heads (BertForMaskedLM's cls.*).
_SKIPPED_PREFIXES = ("pooler.", "cls.")
_SKIPPED_NAMES = ("embeddings.position_ids",)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    architecture: str = "bert"

    @classmethod
    def from_hf(cls, cfg: dict) -> BertConfig:
        """From a config.json; refuses what this encoder does not compute (a one-line reason)."""
        arch = str(cfg.get("model_type", "")).lower()
        if arch != "bert":
            raise ModelLoadError(f"config.json: model_type {arch!r} is not a BERT encoder")
        position = cfg.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ModelLoadError(f"config.json: position_embedding_type {position!r} is not supported (absolute only)")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        try:
            config = cls(vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
                         num_layers=int(cfg["num_hidden_layers"]), num_heads=int(cfg["num_attention_heads"]),
                         intermediate_size=int(cfg["intermediate_size"]),
                         max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
                         type_vocab_size=int(cfg.get("type_vocab_size", 2)),
                         layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), hidden_act=act,
                         pad_token_id=int(cfg.get("pad_token_id") or 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is not a valid BERT config: {exc}") from None
        if config.hidden_size % config.num_heads:
            raise ModelLoadError(f"config.json: hidden_size {config.hidden_size} is not a multiple of "
                                 f"num_attention_heads {config.num_heads}")
        return config


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        x = x + self.token_type_embeddings.weight[0]  # token type 0 throughout: one segment
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask, scale=1.0 / math.sqrt(self.head_dim))
        return out.transpose(1, 2).reshape(batch, length, hidden)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(attended) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    """The encoder: token ids (padded) and their mask in, the last hidden states out."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: [batch, length] (mask 1 for a real token, 0 for padding) →
        [batch, length, hidden]."""
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"input: {input_ids.shape[1]} tokens is more than this model's "
                             f"{self.config.max_position_embeddings} positions")
        # [batch, 1, 1, length]: every query may attend to the real keys of its own row only.
        keys = attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, keys)
        return x


def _fill(model: BertModel, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    """Copies a checkpoint into the model by name; a missing, unexpected or misshapen weight is a
    ModelLoadError naming it. A "bert." prefix (BertForMaskedLM and friends) is dropped."""
    params = dict(model.named_parameters())
    missing = set(params)
    for raw_name, tensor in tensors:
        name = raw_name.removeprefix("bert.")
        if name.startswith(_SKIPPED_PREFIXES) or name in _SKIPPED_NAMES:
            continue
        target = params.get(name)
        if target is None:
            raise ModelLoadError(f"unexpected weight {raw_name!r} for a BERT encoder")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {raw_name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
        missing.discard(name)
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}")


def load_bert(folder: str, device: torch.device, dtype: torch.dtype) -> BertModel:
    """A HF folder's BERT encoder (config.json + safetensors), on `device` in `dtype`, in eval mode."""
    config = BertConfig.from_hf(read_config(folder))
    with torch.device("meta"):
        model = BertModel(config)
    model = model.to_empty(device=device).to(dtype)
    _fill(model, read_safetensors(folder), dtype)
    return model.eval()
