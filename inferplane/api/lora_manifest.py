"""What a LoRA adapter in PEFT's format is (adapter_config.json + adapter_model.safetensors), read
from its files without torch, and whether it fits a base model: the one rule the registry applies
at registration and the worker applies before it loads an adapter into a slot.

Why one home: an adapter the registry accepted must load on every replica of its base, and one the
worker would refuse must be refused at registration with the same words (a 400 naming what).

An adapter fits a base when every tensor is a LoRA half (lora_A [r, in], lora_B [out, r]) of one of
`SERVED_MODULES` in a layer the base has (the MLP ones of a dense MLP layer only), with the base's
in/out sizes, both halves present, a rank at most the replica's max_lora_rank, and no setting the
engine does not serve (DoRA, biases, modules_to_save, fan_in_fan_out, another PEFT type).

The files are a tenant's, so reading them is bounded and checked whole before anything is used:
- both files must be regular files (a FIFO is refused without a blocking open), the config at most
  `MAX_CONFIG_BYTES`; the weights file passes api/safetensors_file.py (header at most 1 MiB, float
  dtypes, offsets that tile the file exactly);
- every value is finite: `check_values` (the registry) and `read_tensors` (the worker, on the very
  bytes it loads) read each tensor once and refuse an infinity or a NaN;
- lora_alpha and alpha_pattern's values are finite numbers (not booleans), rank_pattern's whole
  numbers >= 1, and the flags booleans;
- alpha_pattern / rank_pattern keys are regular expressions (PEFT matches them against module
  names): at most `MAX_PATTERNS` of each, `MAX_PATTERN_CHARS` characters each, compiled and
  matched by RE2, whose time is linear in the text and whose memory is capped (`_PATTERN_MEMORY`),
  so no pattern can backtrack for seconds while it holds the GIL. A pattern RE2 does not accept
  (look-around, backreferences) is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import re2

from inferplane.api.model_config import ModelConfig
from inferplane.api.safetensors_file import (
    SafetensorsError,
    SafetensorsFile,
    TensorInfo,
    check_finite,
    open_regular,
    read_header,
    sha256,
    shown,
)
from inferplane.api.safetensors_file import read_tensors as _read_tensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SERVED_MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
# (our own pattern, linear on any name: no group can match a dot, so nothing backtracks far)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d{1,6})\.(?:self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.\w+)?\.weight$")

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: a few KiB in practice
MAX_PATTERNS = 256  # entries of alpha_pattern, and of rank_pattern
MAX_PATTERN_CHARS = 256  # characters of one pattern
_PATTERN_MEMORY = 1 << 20  # bytes RE2 may use to compile one pattern
PATTERN_FIELDS = ("alpha_pattern", "rank_pattern")


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
    """An adapter's modules and ranks as its files state them; `check` says whether it fits a base,
    `check_values` / `read_tensors` that its values are finite."""

    name: str
    config: dict[str, Any]
    modules: dict[tuple[int, str], ModuleEntry] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> shape
    weights: SafetensorsFile | None = None  # the checked header of the weights file

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

    def check_values(self) -> None:
        """Reads every tensor once: AdapterError naming the first that holds an infinity or a NaN."""
        try:
            check_finite(self._weights())
        except SafetensorsError as exc:
            raise AdapterError(f"adapter {self.name!r}: {exc}") from None

    def read_tensors(self) -> Iterator[tuple[str, TensorInfo, bytearray]]:
        """Each module's lora_A and lora_B bytes, checked finite as they are read (the worker loads
        exactly the bytes checked); AdapterError naming the first that is not."""
        names = [key for entry in self.modules.values() for key in (entry.a_key, entry.b_key)]
        try:
            yield from _read_tensors(self._weights(), names)
        except SafetensorsError as exc:
            raise AdapterError(f"adapter {self.name!r}: {exc}") from None

    def weights_sha256(self) -> str:
        """The weights file's sha256 (what tells two versions of a name apart)."""
        try:
            return sha256(self._weights())
        except SafetensorsError as exc:
            raise AdapterError(f"adapter {self.name!r}: {exc}") from None

    def _weights(self) -> SafetensorsFile:
        if self.weights is None:
            raise AssertionError(f"adapter {self.name!r}: a manifest made without its weights file")
        return self.weights


def _read_config(folder: Path, name: str) -> tuple[dict[str, Any], _Settings]:
    """adapter_config.json, its fields checked (a 400 naming the field, never an internal error)."""
    where = f"adapter {name!r}"
    path = folder / CONFIG_FILE
    try:
        with open_regular(path, CONFIG_FILE) as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise AdapterError(f"{where}: {CONFIG_FILE} is missing in {folder}") from None
    except SafetensorsError as exc:
        raise AdapterError(f"{where}: {exc}") from None
    except OSError as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{where}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({shown(str(exc))})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if not isinstance(kind, str) or kind.upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {shown(str(kind))} is not served (only LORA)")
    for flag in ("use_dora", "fan_in_fan_out", "use_rslora"):
        if config.get(flag) is not None and not isinstance(config[flag], bool):
            raise AdapterError(f"{where}: {flag} must be true or false")
    saved, bias = config.get("modules_to_save"), config.get("bias", "none")
    if saved is not None and not isinstance(saved, list):
        raise AdapterError(f"{where}: modules_to_save must be a list or null")
    if bias is not None and not isinstance(bias, str):
        raise AdapterError(f"{where}: bias must be a string")
    refused = {"use_dora": bool(config.get("use_dora")), "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
               "modules_to_save": bool(saved), "bias": bias not in (None, "none")}
    for flag, present in refused.items():
        if present:
            raise AdapterError(f"{where}: {flag} is not served (plain LoRA on linear layers only)")
    if config.get("r") is not None:
        _whole(config["r"], f"{where}: r")
    alpha = config.get("lora_alpha")
    settings = _Settings(alpha=8.0 if alpha is None else _finite(alpha, f"{where}: lora_alpha"),
                         rslora=bool(config.get("use_rslora")),
                         alpha_pattern=_patterns(config, "alpha_pattern", where))
    _patterns(config, "rank_pattern", where)  # checked, not used: ranks are the tensors' shapes
    return config, settings


@dataclass(frozen=True)
class _Settings:
    """What of the config the scaling reads, checked."""

    alpha: float
    rslora: bool
    alpha_pattern: list[tuple[Any, float]]  # (RE2 pattern, alpha), first match wins as in PEFT

    def scaling(self, module_key: str, rank: int) -> float:
        """PEFT's: the first alpha_pattern key matching the module's name (in full, or after a dot),
        else lora_alpha; over r, or sqrt(r) with rsLoRA."""
        alpha = next((value for pattern, value in self.alpha_pattern if pattern.fullmatch(module_key)), self.alpha)
        return alpha / (math.sqrt(rank) if self.rslora else rank)


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterError(f"{what} must be a number, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise AdapterError(f"{what} must be a finite number")
    return number


def _whole(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{what} must be a whole number of at least 1")
    return value


def _pattern_options() -> Any:
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _PATTERN_MEMORY
    return options


def compile_pattern(key: str, what: str) -> Any:
    """A PEFT alpha_pattern / rank_pattern key as RE2 matches it (`fullmatch` on a module name):
    the key alone, or the key after any prefix ending in a dot, as PEFT's get_pattern_key does.
    The key must be a pattern on its own (so it cannot close the group around it)."""
    if len(key) > MAX_PATTERN_CHARS:
        raise AdapterError(f"{what}: the key {shown(key)!r} is longer than {MAX_PATTERN_CHARS} characters")
    try:
        re2.compile(key, _pattern_options())
        return re2.compile(rf"(?:.*\.)?(?:{key})", _pattern_options())
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise AdapterError(f"{what}: the key {shown(key)!r} is not a pattern served here ({shown(reason)}); "
                           "patterns run on RE2: no look-around or backreferences") from None


def _patterns(config: dict[str, Any], field_name: str, where: str) -> list[tuple[Any, float]]:
    entries = config.get(field_name)
    if entries is None:
        return []
    what = f"{where}: {field_name}"
    if not isinstance(entries, dict):
        raise AdapterError(f"{what} must be an object of pattern -> value")
    if len(entries) > MAX_PATTERNS:
        raise AdapterError(f"{what} has {len(entries)} patterns; at most {MAX_PATTERNS} are served")
    found = []
    for key, value in entries.items():
        pattern = compile_pattern(key, what)
        entry = f"{what}[{shown(key)!r}]"
        found.append((pattern, _finite(value, entry) if field_name == "alpha_pattern" else _whole(value, entry)))
    return found


def read_manifest(folder: Path | str, name: str) -> AdapterManifest:
    """The adapter in `folder`, its config and the weights file's header checked for form (not yet
    against a base, nor its values: `check_values` or `read_tensors` read those)."""
    where = f"adapter {name!r}"
    if "\x00" in str(folder):
        raise AdapterError(f"{where}: the adapter's path holds a NUL byte")
    folder = Path(folder)
    if not folder.is_dir():
        raise AdapterError(f"{where}: {folder} is not a folder with PEFT files")
    config, settings = _read_config(folder, name)
    try:
        weights = read_header(folder / WEIGHTS_FILE)
    except FileNotFoundError:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} is missing in {folder}") from None
    except SafetensorsError as exc:
        raise AdapterError(f"{where}: {exc}") from None
    shapes = {key: info.shape for key, info in weights.tensors.items()}
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{where}: tensor {shown(key)} is not a LoRA weight of a served module "
                               f"({', '.join(SERVED_MODULES)})")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in SERVED_MODULES:
            raise AdapterError(f"{where}: target module {shown(module)} is not served "
                               f"(served: {', '.join(SERVED_MODULES)})")
        halves.setdefault((layer, module), {})[half] = key
    if not halves:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    manifest = AdapterManifest(name=name, config=config, shapes=shapes, weights=weights)
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} without its other half")
        rank = shapes[pair["A"]][0] if shapes[pair["A"]] else 0
        if rank < 1:
            raise AdapterError(f"{where}: layer {layer} {module} has an empty lora_A")
        block = "self_attn" if module in ATTENTION_MODULES else "mlp"
        manifest.modules[(layer, module)] = ModuleEntry(
            pair["A"], pair["B"], rank, settings.scaling(f"model.layers.{layer}.{block}.{module}", rank))
    return manifest
