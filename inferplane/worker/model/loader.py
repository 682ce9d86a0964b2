"""Finding and loading a model: a built-in alias, a HF folder (config.json + safetensors,
sharded too) or a GGUF file. Every failure is a ModelLoadError with a one-line reason."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from inferplane.api.model_config import ModelConfig, ModelLoadError
from inferplane.api.model_resolution import BUILTIN_MODELS, BuiltinModelMissing, builtin_model_path
from inferplane.api.tokenizer import TextTokenizer
from inferplane.worker.model.hf_folder import read_config, read_safetensors
from inferplane.worker.model.hf_weights import hf_tensors_for
from inferplane.worker.model.layers import Rotary
from inferplane.worker.model.llama import LlamaForCausalLM, local_rotary
from inferplane.worker.model.tokenizer import load_gguf_tokenizer, load_hf_tokenizer


def resolve_model_path(model: str) -> str:
    """An alias, a .gguf file or a HF folder → a path that exists."""
    if model in BUILTIN_MODELS:
        try:
            return str(builtin_model_path(model))
        except BuiltinModelMissing as exc:
            raise ModelLoadError(str(exc)) from None
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ModelLoadError(f"model {model!r} not found: not a path and not a built-in alias ({known})")
    return path


@dataclass
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: TextTokenizer | None


def _fill(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in params:
            raise ModelLoadError(f"unexpected weight {name!r} for this architecture")
        target = params[name]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(dtype))
        missing.discard(name)
        if model.config.tie_word_embeddings and name == "model.embed_tokens.weight":
            missing.discard("lm_head.weight")
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(sorted(missing)[:5])}")


def load_model(model: str, device: torch.device, dtype: torch.dtype, max_positions: int | None = None) -> LoadedModel:
    path = resolve_model_path(model)
    if os.path.isdir(path):
        try:
            config = ModelConfig.from_hf(read_config(path))
        except KeyError as exc:
            raise ModelLoadError(f"{path}/config.json is not a valid model config: missing {exc}") from exc
        tensors = hf_tensors_for(config, read_safetensors(path))
        tokenizer = load_hf_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    elif path.endswith(".gguf"):
        from inferplane.api.model_config import config_from_gguf
        from inferplane.worker.model.gguf_file import load_gguf_tensors, open_gguf

        reader = open_gguf(path)
        config = config_from_gguf(reader)
        tensors = load_gguf_tensors(reader, config)
        tokenizer = load_gguf_tokenizer(reader)
    else:
        raise ModelLoadError(f"{path}: expected a HF model folder or a .gguf file")
    with torch.device("meta"):
        module = LlamaForCausalLM(config, max_positions)
    module = module.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    # to_empty leaves buffers uninitialised: the rotary tables are rebuilt, in float32, on the device.
    module.rotary = Rotary(config, max_positions or config.max_position_embeddings).to(device)
    local = local_rotary(config, max_positions)
    module.rotary_local = None if local is None else local.to(device)
    _fill(module, tensors, dtype)
    module.eval()
    return LoadedModel(name=model, path=path, config=config, model=module, tokenizer=tokenizer)

