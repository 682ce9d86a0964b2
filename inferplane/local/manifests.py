"""InferenceDeployment manifests on one machine: the built-in default, the files `inferplane up`
is given, the one `inferplane serve` generates, and those applied through the admin API and kept
in `<home>/deployments/`. Each is checked as the API server would check it (SpecError naming the
field), so a manifest that runs here is one a cluster takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from inferplane.api.deployment import InferenceDeploymentSpec, SpecError, prefill_pool_name

API_VERSION = "inferplane.io/v1alpha1"
DEFAULT_DEPLOYMENT = {
    "apiVersion": API_VERSION,
    "kind": "InferenceDeployment",
    "metadata": {"name": "smollm2-135m"},
    "spec": {"model": {"name": "smollm2-135m"}, "runtime": "auto", "replicas": 1,
             "resources": {"cpu": "2", "memory": "4Gi"}, "engine": {"kvCacheMemory": "512Mi"}},
}


@dataclass
class Manifest:
    name: str
    spec: InferenceDeploymentSpec


# A Kubernetes object name (RFC 1123 subdomain): also what names the processes' log files and folders.
OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def resource_name(text: str) -> str:
    """`text` (a file or folder name) as an InferenceDeployment name: lower case, runs of anything
    but letters and digits as one "-", at most 63 characters (a DNS label, as a cluster needs)."""
    name = "-".join(piece for piece in re.split(r"[^a-z0-9]+", text.lower()) if piece)[:63].strip("-")
    if not name:
        raise SpecError("metadata.name", f"cannot make a deployment name of {text!r}; pass --name")
    return name


def served_manifest(name: str, model: dict, *, runtime: str = "auto", kind: str = "generate",
                    replicas: int = 1, served_name: str | None = None) -> Manifest:
    """The deployment `inferplane serve` generates: the built-in default's resources and engine,
    with this model, runtime, kind and replica count, checked as any manifest is. `served_name`:
    the model id clients use, where it is not the registry name (serving.servedModelName)."""
    spec = {**DEFAULT_DEPLOYMENT["spec"], "model": model, "runtime": runtime, "kind": kind, "replicas": replicas}
    if served_name is not None:
        spec["serving"] = {"servedModelName": served_name}
    if kind == "embedding":
        spec.pop("engine")  # the KV cache budget is a generative model's
    return Manifest(name, InferenceDeploymentSpec.from_dict(spec))


def manifest_of(doc: Any, where: str) -> Manifest:
    """One InferenceDeployment document (a file's, or an admin API body) checked as the API server
    would: SpecError naming the field."""
    if not isinstance(doc, dict) or doc.get("kind") != "InferenceDeployment":
        got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise SpecError("kind", f"{where}: expected kind InferenceDeployment, got {got!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not name:
        raise SpecError("metadata.name", f"{where}: required")
    if not isinstance(name, str) or not OBJECT_NAME.fullmatch(name):
        raise SpecError("metadata.name", f"{where}: {name!r} is not a Kubernetes object name (lower case "
                                         "letters, digits, '-' and '.', at most 253)")
    return Manifest(name, InferenceDeploymentSpec.from_dict(doc.get("spec")))


def check_prefill_pool_names(manifests: list[Manifest]) -> None:
    """SpecError where a prefill pool's processes would take another deployment's name."""
    names = {m.name for m in manifests}
    for manifest in manifests:  # a prefill pool's processes are named after their deployment
        pool = prefill_pool_name(manifest.name)
        if manifest.spec.disaggregation.enabled and pool in names:
            raise SpecError("disaggregation.enabled", f"{manifest.name}'s prefill pool would be named {pool}, "
                                                      "which another InferenceDeployment is; rename one of them")


def read_manifests(paths: list[str], *, default: bool = True) -> list[Manifest]:
    """The same YAML `kubectl apply -f` takes (several documents per file allowed); none given: the
    built-in default deployment, unless `default` is False."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.extend((path, d) for d in yaml.safe_load_all(f) if d)
    if not docs and default:
        docs = [("(built-in default)", DEFAULT_DEPLOYMENT)]
    manifests = [manifest_of(doc, path) for path, doc in docs]
    check_prefill_pool_names(manifests)
    return manifests


def kept_folder(home: Path) -> Path:
    return home / "deployments"


def kept_documents(home: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file, document) of each deployment applied through the API and kept, in name order."""
    folder = kept_folder(home)
    if not folder.is_dir():
        return []
    return [(str(path), yaml.safe_load(path.read_text())) for path in sorted(folder.glob("*.yaml"))]
