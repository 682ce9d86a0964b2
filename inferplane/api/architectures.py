"""The one home of which model architectures inferplane serves, and what kind of model each is.

Torch-free, at the bottom of the house: the registry (control plane) reads an architecture from a
file at registration and refuses one the workers cannot load; the worker's loader picks the module
for it; a deployment's `kind` is checked against it. An architecture is named as the file names
it: a GGUF file's `general.architecture` ("gemma3", "qwen3moe") or a Hugging Face config's
`model_type` ("gemma3_text", "qwen3_moe"); both spellings map to one canonical name here.
"""

from __future__ import annotations

from typing import Literal

ModelKind = Literal["generate", "embedding"]
MODEL_KINDS: tuple[ModelKind, ...] = ("generate", "embedding")

# canonical name -> kind. Generative ones run in every runtime (paged, radix, cpu-int8); embedding
# ones in the embedding runtime.
ARCHITECTURE_KINDS: dict[str, ModelKind] = {
    "llama": "generate",
    "mistral": "generate",
    "mixtral": "generate",
    "qwen2": "generate",
    "qwen3": "generate",
    "qwen3_moe": "generate",
    "gemma2": "generate",
    "gemma3": "generate",
    "phi3": "generate",
    "bert": "embedding",
}

# Other spellings of the same architecture (GGUF's, HF's model_type, HF's class names).
_ALIASES: dict[str, str] = {
    "gemma3_text": "gemma3",
    "qwen3moe": "qwen3_moe",
    "llamaforcausallm": "llama",
    "mistralforcausallm": "mistral",
    "mixtralforcausallm": "mixtral",
    "qwen2forcausallm": "qwen2",
    "qwen3forcausallm": "qwen3",
    "qwen3moeforcausallm": "qwen3_moe",
    "gemma2forcausallm": "gemma2",
    "gemma3forcausallm": "gemma3",
    "phi3forcausallm": "phi3",
    "bertmodel": "bert",
    "bertformaskedlm": "bert",
}


def canonical_architecture(name: str | None) -> str | None:
    """The canonical name of an architecture as a file spells it; None when inferplane serves none by
    that name."""
    if not name:
        return None
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in ARCHITECTURE_KINDS else None


def config_architecture(config: dict) -> str | None:
    """The architecture a Hugging Face config.json names: the first of its `model_type` and its
    class names (`architectures`) that inferplane serves, canonical; else the first it names (for
    the error that refuses it); None when it names none. The registry and the workers both read a
    folder's architecture by this rule."""
    architectures = config.get("architectures")
    names = [config.get("model_type"), *(architectures if isinstance(architectures, list) else [])]
    names = [str(n) for n in names if isinstance(n, str) and n]
    for name in names:
        canonical = canonical_architecture(name)
        if canonical is not None:
            return canonical
    return names[0] if names else None


def model_kind(architecture: str | None) -> ModelKind | None:
    """"generate" or "embedding" for a served architecture, None otherwise."""
    canonical = canonical_architecture(architecture)
    return None if canonical is None else ARCHITECTURE_KINDS[canonical]


def unsupported_message(name: str | None) -> str:
    """One line naming the architecture and what is served instead."""
    served = ", ".join(sorted(ARCHITECTURE_KINDS))
    return f"architecture {name!r} is not supported (supported: {served})"
