"""The model registry, by concept: records.py (rows, visibility, what a deployment runs), sources.py
(aliases, confined paths, fetched URIs, claims), weights.py (reading and checking weights) and
adapters.py (LoRA adapters bound to a base model version)."""

from inferplane.control_plane.registry.adapters import ADAPTER_KIND, list_adapters, register_adapter, resolve_adapter
from inferplane.control_plane.registry.records import (
    NAME_RE,
    PLATFORM,
    RESERVED_NAMES,
    VERSION_RE,
    ModelInfo,
    ModelNotReady,
    delete_model,
    get_model,
    is_visible,
    list_models,
    list_versions,
    parse_ref,
    register_model,
    resolve_for_deployment,
    resolve_model,
    verify_model,
)
from inferplane.control_plane.registry.sources import alias_path, confine_source, resolve_source, uri_scheme
from inferplane.control_plane.registry.weights import (
    MAX_CONTEXT_LENGTH,
    CorruptWeights,
    InvalidMetadata,
    ModelMetadata,
    UnsupportedArchitecture,
    clear_inspect_cache,
    detect_format,
    inspect_model,
)

__all__ = [
    "ADAPTER_KIND", "MAX_CONTEXT_LENGTH", "NAME_RE", "PLATFORM", "RESERVED_NAMES", "VERSION_RE", "CorruptWeights",
    "InvalidMetadata", "ModelInfo", "ModelMetadata", "ModelNotReady", "UnsupportedArchitecture", "alias_path",
    "clear_inspect_cache", "confine_source", "delete_model", "detect_format", "get_model", "inspect_model",
    "is_visible", "list_adapters", "list_models", "list_versions", "parse_ref", "register_adapter", "register_model",
    "resolve_adapter", "resolve_for_deployment", "resolve_model", "resolve_source", "uri_scheme", "verify_model",
]
