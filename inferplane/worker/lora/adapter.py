"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read and checked
against the base model it is to run on.

Why checked here, at load: an adapter whose target modules, shapes or rank do not fit the base
would otherwise fail inside a batch that also carries other tenants' rows. `AdapterError` names
what does not fit, in one line.

Invariants of a `LoraAdapter`:
- `weights[(layer, module)] = (A [r, in], B_scaled [out, r])` with B already multiplied by the
  adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA; per module where alpha_pattern or
  rank_pattern say so), so serving it is x @ A.T @ B_scaled.T added to the base projection.
- every module is one of `SERVED_MODULES`, of a layer the base has (and, for the MLP ones, a dense
  MLP layer), with the base's in/out sizes and a rank at most the engine's `max_lora_rank`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferplane.worker.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SERVED_MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """An adapter cannot be served on this base; the message names what does not fit."""


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

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) features of a served module on `config`'s layers."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (config.hidden_size, q_out), "k_proj": (config.hidden_size, kv_out),
        "v_proj": (config.hidden_size, kv_out), "o_proj": (q_out, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }[module]


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter: {CONFIG_FILE} is missing in {folder}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter: {CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter: {CONFIG_FILE} must hold a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"adapter: peft_type {kind} is not served (only LORA)")
    refused = {"use_dora": bool(config.get("use_dora")), "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
               "modules_to_save": bool(config.get("modules_to_save")),
               "bias": config.get("bias", "none") not in (None, "none")}
    for name, present in refused.items():
        if present:
            raise AdapterError(f"adapter: {name} is not served (plain LoRA on linear layers only)")
    return config


def _scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's scaling for one module: its alpha (alpha_pattern may name it) over its rank, or over
    sqrt(rank) with rsLoRA."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module_key) or pattern == module_key.rsplit(".", 1)[-1]:
            alpha = float(value)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def load_adapter(request: LoraRequest, base: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """The adapter at `request.path`, checked against `base`; AdapterError naming what does not fit."""
    from safetensors import safe_open

    folder = Path(request.path)
    if not folder.is_dir():
        raise AdapterError(f"adapter {request.name!r}: {folder} is not a folder with PEFT files")
    config = _read_config(folder)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"adapter {request.name!r}: {WEIGHTS_FILE} is missing in {folder}")
    digest = hashlib.sha256(weights_path.read_bytes()).hexdigest()
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as handle:
        for key in handle.keys():
            match = _KEY.match(key)
            if match is None:
                raise AdapterError(f"adapter {request.name!r}: tensor {key} is not a LoRA weight of a served "
                                   f"module ({', '.join(SERVED_MODULES)})")
            layer, module, half = int(match[1]), match[2], match[3]
            if module not in SERVED_MODULES:
                raise AdapterError(f"adapter {request.name!r}: target module {module} is not served "
                                   f"(served: {', '.join(SERVED_MODULES)})")
            halves.setdefault((layer, module), {})[half] = handle.get_tensor(key)
    if not halves:
        raise AdapterError(f"adapter {request.name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, module), pair in sorted(halves.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {request.name!r}: {where} has lora_{''.join(pair)} without its other half")
        if layer >= base.num_layers:
            raise AdapterError(f"adapter {request.name!r}: {where}: the base model has {base.num_layers} layers")
        if module in MLP_MODULES and base.is_moe_layer(layer):
            raise AdapterError(f"adapter {request.name!r}: {where}: the base's layer {layer} is a mixture of "
                               "experts; LoRA on experts is not served")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        in_features, out_features = module_shape(base, module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"adapter {request.name!r}: {where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                f"the base's {in_features} -> {out_features} projection")
        if rank > max_rank:
            raise AdapterError(f"adapter {request.name!r}: {where} has rank {rank}, above max_lora_rank {max_rank}")
        prefix = "self_attn" if module in ATTENTION_MODULES else "mlp"
        scale = _scaling(config, f"model.layers.{layer}.{prefix}.{module}", rank)
        weights[(layer, module)] = (a.to(device=device, dtype=dtype),
                                    (b.double() * scale).to(device=device, dtype=dtype))
        top_rank = max(top_rank, rank)
    return LoraAdapter(name=request.name, digest=digest, rank=top_rank, weights=weights)
