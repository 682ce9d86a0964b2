"""Hugging Face checkpoint tensors as the modules here name and shape them, per family.

The modules keep HF's names (llama.py), so most tensors load as they are. What differs:
- Gemma stores norm weights as w for a (1 + w) norm: the 1 is added once here (gemma.py).
- Phi-3 fuses q/k/v and gate/up in its checkpoints: they are split here (cpu-int8 fuses them again
  its own way, quant/convert.py).
- Mixtral names its experts `block_sparse_moe.experts.N.w1/w2/w3`; transformers 5 may save experts
  stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]): both become
  per-expert `mlp.experts.N.{gate,up,down}_proj.weight` (moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from inferplane.api.model_config import ModelConfig
from inferplane.worker.model.gemma import gemma_norm_weight

_MIXTRAL_EXPERT = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(experts\.\d+\.)?(w1|w2|w3|gate)\.weight$")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_tensors_for(config: ModelConfig,
                   tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in this package's naming for `config`'s family."""
    gemma = config.sandwich_norms
    for name, tensor in tensors:
        if gemma:
            yield name, gemma_norm_weight(name, tensor)
            continue
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                yield f"{prefix}{part}.weight", piece
            continue
        if name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.chunk(2, dim=0)
            yield f"{prefix}gate_proj.weight", gate
            yield f"{prefix}up_proj.weight", up
            continue
        mixtral = _MIXTRAL_EXPERT.match(name)
        if mixtral:
            layer, expert, which = mixtral.groups()
            if which == "gate":
                yield f"{layer}mlp.gate.weight", tensor
            else:
                yield f"{layer}mlp.{expert}{_MIXTRAL_NAMES[which]}.weight", tensor
            continue
        stacked = _STACKED_EXPERTS.match(name)
        if stacked:
            prefix, which = stacked.groups()
            for e in range(tensor.shape[0]):
                if which == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", tensor[e]
                else:
                    gate, up = tensor[e].chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
            continue
        yield name, tensor
