"""A LoRA adapter loaded for the engine: its PEFT files read and checked against the base by the
rule the registry applies (api/lora_manifest.py), then its tensors read.

Invariants of a `LoraAdapter`:
- `weights[(layer, module)] = (A [r, in], B_scaled [out, r])` with B already multiplied by the
  adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA; per module where alpha_pattern
  says so), so serving it is x @ A.T @ B_scaled.T added to the base projection.
- it fits the base (api/lora_manifest.AdapterManifest.check) at the engine's max_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferplane.api.lora_manifest import (
    ATTENTION_MODULES,
    CONFIG_FILE,
    MLP_MODULES,
    SERVED_MODULES,
    WEIGHTS_FILE,
    AdapterError,
    BaseShape,
    read_manifest,
)
from inferplane.api.model_config import ModelConfig
from inferplane.storage.digest import sha256_file

__all__ = ["ATTENTION_MODULES", "CONFIG_FILE", "MLP_MODULES", "SERVED_MODULES", "WEIGHTS_FILE", "AdapterError",
           "LoraAdapter", "LoraRequest", "load_adapter", "module_shape"]


@dataclass(frozen=True)
class LoraRequest:
    """Which adapter a request runs under: a name (unique per base model; a new version of the same
    name is a new `key`) and the folder holding its PEFT files."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not self.name:
            raise AdapterError("adapter: the name must not be empty")


@dataclass
class LoraAdapter:
    name: str
    digest: str  # sha256 of the weights file: two versions of a name differ here
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def key(self) -> str:
        """What slots, prefix caches and metrics tell adapters apart by: name and version."""
        return f"{self.name}@{self.digest[:16]}"


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a served module on `config`'s layers."""
    return BaseShape.of(config).module_shape(module)


def load_adapter(request: LoraRequest, base: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """The adapter at `request.path`, checked against `base`; AdapterError naming what does not fit."""
    from safetensors import safe_open

    manifest = read_manifest(request.path, request.name)
    manifest.check(BaseShape.of(base), max_rank)
    weights_path = Path(request.path) / WEIGHTS_FILE
    digest = sha256_file(weights_path)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as handle:
        for key, entry in manifest.modules.items():
            a, b = handle.get_tensor(entry.a_key), handle.get_tensor(entry.b_key)
            weights[key] = (a.to(device=device, dtype=dtype), (b.double() * entry.scaling).to(device=device,
                                                                                              dtype=dtype))
    return LoraAdapter(name=request.name, digest=digest, rank=manifest.rank, weights=weights)
