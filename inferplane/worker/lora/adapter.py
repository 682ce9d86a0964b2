"""A LoRA adapter loaded for the engine: its PEFT files read and checked against the base by the
rule the registry applies (api/lora_manifest.py), then its tensors read (once, by that module's
reader, which checks the very bytes loaded to be finite).

Invariants of a `LoraAdapter`:
- `weights[(layer, module)] = (A [r, in], B_scaled [out, r])` with B already multiplied by the
  adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA; per module where alpha_pattern
  says so), so serving it is x @ A.T @ B_scaled.T added to the base projection.
- every value is finite in the engine's dtype (a scaling that overflows it is refused here).
- it fits the base (api/lora_manifest.AdapterManifest.check) at the engine's max_lora_rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inferplane.api.kv_blocks import adapter_cache_key
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
        if "\x00" in self.name or "\x00" in self.path:
            shown = self.name.replace("\x00", "?")
            raise AdapterError(f"adapter {shown!r}: the name and path must not hold a NUL byte")


@dataclass
class LoraAdapter:
    name: str
    digest: str  # sha256 of the weights file: two versions of a name differ here
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def key(self) -> str:
        """What slots, prefix caches and metrics tell adapters apart by: name and version."""
        return adapter_cache_key(self.name, self.digest)


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a served module on `config`'s layers."""
    return BaseShape.of(config).module_shape(module)


_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def load_adapter(request: LoraRequest, base: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """The adapter at `request.path`, checked against `base`; AdapterError naming what does not fit."""
    manifest = read_manifest(request.path, request.name)
    manifest.check(BaseShape.of(base), max_rank)
    digest = manifest.weights_sha256()
    tensors = {name: torch.frombuffer(data, dtype=_TORCH_DTYPES[info.dtype]).reshape(info.shape)
               for name, info, data in manifest.read_tensors()}
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), entry in manifest.modules.items():
        a = tensors[entry.a_key].to(device=device, dtype=dtype)
        b = (tensors[entry.b_key].double() * entry.scaling).to(device=device, dtype=dtype)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"adapter {request.name!r}: layer {layer} {module}: its weights (lora_B times the "
                               f"scaling {entry.scaling:g}) overflow this replica's {str(dtype).split('.')[-1]}")
        weights[(layer, module)] = (a, b)
    return LoraAdapter(name=request.name, digest=digest, rank=manifest.rank, weights=weights)
