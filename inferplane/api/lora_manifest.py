"""What a LoRA adapter in PEFT's format is (adapter_config.json + adapter_model.safetensors), read
from its files without torch, and whether it fits a base model: the one rule the registry applies
at registration and the worker applies before it loads an adapter into a slot.

Why one home: an adapter the registry accepted must load on every replica of its base, and one the
worker would refuse must be refused at registration with the same words (a 400 naming what).

An adapter fits a base when every tensor is a LoRA half (lora_A [r, in], lora_B [out, r]) of one of
`SERVED_MODULES` in a layer the base has (the MLP ones of a dense MLP layer only), with the base's
in/out sizes, both halves present, a rank at most the replica's max_lora_rank, and no setting the
engine does not serve (DoRA, biases, modules_to_save, fan_in_fan_out, another PEFT type).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferplane.api.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SERVED_MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")
_MAX_HEADER = 100 * 2**20


class AdapterError(ValueError):
    """An adapter cannot be served on this base; the message names what does not fit."""


@dataclass(frozen=True)
class BaseShape:
    """The base model's numbers an adapter must fit."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    moe_layers: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts

    @classmethod
    def of(cls, config: ModelConfig) -> BaseShape:
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   intermediate_size=config.intermediate_size, q_size=config.num_heads * config.head_dim,
                   kv_size=config.num_kv_heads * config.head_dim,
                   moe_layers=frozenset(i for i in range(config.num_layers) if config.is_moe_layer(i)))

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in, out) features of a served module."""
        return {
            "q_proj": (self.hidden_size, self.q_size), "k_proj": (self.hidden_size, self.kv_size),
            "v_proj": (self.hidden_size, self.kv_size), "o_proj": (self.q_size, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }[module]


@dataclass(frozen=True)
class ModuleEntry:
    a_key: str
    b_key: str
    rank: int
    scaling: float  # PEFT's: lora_alpha (or alpha_pattern's) / r, or / sqrt(r) with rsLoRA


@dataclass
class AdapterManifest:
    """An adapter's modules and ranks as its files state them; `check` says whether it fits a base."""

    name: str
    config: dict[str, Any]
    modules: dict[tuple[int, str], ModuleEntry] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> shape

    @property
    def rank(self) -> int:
        return max(entry.rank for entry in self.modules.values())

    def check(self, base: BaseShape, max_rank: int | None = None) -> None:
        """AdapterError naming the first thing that does not fit `base` (and `max_rank`)."""
        for (layer, module), entry in sorted(self.modules.items()):
            where = f"adapter {self.name!r}: layer {layer} {module}"
            if layer >= base.num_layers:
                raise AdapterError(f"{where}: the base model has {base.num_layers} layers")
            if module in MLP_MODULES and layer in base.moe_layers:
                raise AdapterError(f"{where}: the base's layer {layer} is a mixture of experts; "
                                   "LoRA on experts is not served")
            a, b = self.shapes[entry.a_key], self.shapes[entry.b_key]
            in_features, out_features = base.module_shape(module)
            if len(a) != 2 or len(b) != 2 or a[1] != in_features or tuple(b) != (out_features, a[0]):
                raise AdapterError(f"{where}: lora_A {tuple(a)} and lora_B {tuple(b)} do not fit the base's "
                                   f"{in_features} -> {out_features} projection")
            if max_rank is not None and entry.rank > max_rank:
                raise AdapterError(f"{where} has rank {entry.rank}, above max_lora_rank {max_rank}")


def _read_config(folder: Path) -> dict[str, Any]:
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


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header (8-byte length, then JSON), no tensor read."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise AdapterError(f"adapter: {path.name} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise AdapterError(f"adapter: {path.name} has a {length}-byte header; not a safetensors file")
            header = json.loads(handle.read(length))
    except OSError as exc:
        raise AdapterError(f"adapter: {path.name} cannot be read: {exc}") from None
    except ValueError:
        raise AdapterError(f"adapter: {path.name} is not a safetensors file (bad header)") from None
    return {name: tuple(int(d) for d in entry["shape"]) for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "shape" in entry}


def _scaling(config: dict[str, Any], module_key: str, rank: int) -> float:
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module_key):
            alpha = float(value)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_manifest(folder: Path | str, name: str) -> AdapterManifest:
    """The adapter in `folder`, its names and shapes checked for form (not yet against a base)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder with PEFT files")
    config = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is missing in {folder}")
    shapes = safetensors_shapes(weights)
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA weight of a served module "
                               f"({', '.join(SERVED_MODULES)})")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in SERVED_MODULES:
            raise AdapterError(f"adapter {name!r}: target module {module} is not served "
                               f"(served: {', '.join(SERVED_MODULES)})")
        halves.setdefault((layer, module), {})[half] = key
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    manifest = AdapterManifest(name=name, config=config, shapes=shapes)
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} without its "
                               "other half")
        rank = shapes[pair["A"]][0] if shapes[pair["A"]] else 0
        if rank < 1:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has an empty lora_A")
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        manifest.modules[(layer, module)] = ModuleEntry(
            pair["A"], pair["B"], rank, _scaling(config, f"model.layers.{layer}.{block}.{module}", rank))
    return manifest
