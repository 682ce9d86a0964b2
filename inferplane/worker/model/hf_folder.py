"""Reading a Hugging Face folder, for every loader: its config.json and its safetensors weights
(one file or shards)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import torch

from inferplane.api.model_config import ModelLoadError


def safetensors_files(folder: str) -> list[str]:
    """The folder's weight files: the shards its index names, or every .safetensors file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    return [os.path.join(folder, f) for f in files]


def read_safetensors(folder: str) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight in the folder; an unreadable file is a ModelLoadError."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def read_config(folder: str) -> dict:
    """The folder's config.json; a missing or unreadable one is a ModelLoadError naming it."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not a valid model config: {exc}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return config
