"""Sentence pooling as a sentence-transformers model folder declares it.

A sentence-transformers folder lists its modules in modules.json: the Transformer (the encoder),
then Pooling (its config in e.g. 1_Pooling/config.json), then optionally Normalize. The embedding a
client gets must be what `SentenceTransformer(folder).encode` gives, so the pooling is read from
those files, never assumed; a module this runtime does not compute (Dense, a custom class) is
refused at load with its name, rather than served wrong.

Pooling modes, in the order sentence-transformers concatenates them when several are on: cls (the
first token), max (per dimension, over real tokens), mean (over real tokens), mean_sqrt_len_tokens
(the sum over real tokens divided by the square root of their count).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferplane.api.model_config import ModelLoadError

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
# sentence-transformers' earlier config keys (one boolean per mode), in its concatenation order.
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The modules this runtime computes, by class name (sentence-transformers has moved them between
# packages: sentence_transformers.models.Pooling, ...sentence_transformer.modules.Pooling).
_ORDER = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden [batch, length, dim], mask [batch, length] (1: a real token) → [batch, dim × modes],
        computed in float32 whatever the model's dtype."""
        hidden = hidden.float()
        real = mask.to(hidden.dtype).unsqueeze(-1)
        pooled = []
        for mode in self.modes:
            if mode == "cls":
                pooled.append(hidden[:, 0])
            elif mode == "max":
                pooled.append(hidden.masked_fill(real == 0, float("-inf")).amax(dim=1))
            else:
                total = (hidden * real).sum(dim=1)
                count = real.sum(dim=1).clamp(min=1e-9)
                pooled.append(total / (count if mode == "mean" else count.sqrt()))
        out = torch.cat(pooled, dim=-1)
        return F.normalize(out, p=2, dim=-1) if self.normalize else out


def _modes(config: dict, path: str) -> tuple[str, ...]:
    """The modes a Pooling config turns on: `pooling_mode` (sentence-transformers 5+: a name or a
    list) or the earlier booleans."""
    if "pooling_mode" in config:
        value = config["pooling_mode"]
        modes = (value,) if isinstance(value, str) else tuple(value or ())
    else:
        modes = tuple(mode for key, mode in _LEGACY_KEYS.items() if config.get(key))
    if not modes:
        raise ModelLoadError(f"{path}: no pooling mode is on")
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise ModelLoadError(f"{path}: pooling mode {unknown[0]!r} is not supported ({', '.join(POOLING_MODES)})")
    return modes


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def read_pooling(folder: str) -> Pooling:
    """The folder's pooling. A folder without modules.json (a plain HF encoder) pools by mean
    without normalizing, as sentence-transformers does when it wraps such a model."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.exists(modules_path):
        return Pooling()
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path}: expected a list of modules")
    modes: tuple[str, ...] | None = None
    normalize = False
    seen: list[str] = []
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = kind.rsplit(".", 1)[-1]
        if not kind.startswith("sentence_transformers.") or name not in _ORDER or _ORDER.index(name) != len(seen):
            raise ModelLoadError(f"{modules_path}: module {kind or module!r} is not supported here "
                                 "(Transformer, Pooling, then optionally Normalize)")
        seen.append(name)
        if name == "Pooling":
            config_path = os.path.join(folder, module.get("path", ""), "config.json")
            modes = _modes(_read_json(config_path), config_path)
        normalize = normalize or name == "Normalize"
    if modes is None:
        raise ModelLoadError(f"{modules_path}: no Pooling module")
    return Pooling(modes, normalize)
