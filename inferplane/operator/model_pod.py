"""How a worker pod gets its weights: a volume, maybe a fetch-model init container, the --model path.

- `model.uri` a path in the image, or `pvc://claim/path` (mounted read-only at /models): the worker
  loads it as is, as before.
- `model.name` resolved through the registry (`ResolvedModel`): an init container runs
  `inferplane fetch-model`, which downloads into the node cache keyed by the digest, verifies the
  sha256 and only then renames the entry into place; the worker loads
  `<cache>/<sha256>/<file>` and starts only after the init container succeeded. A mismatch stops the
  pod with the reason as its termination message. The digest is also a pod annotation, so a new
  version changes the pod template and the Deployment rolls.
- `model.name` with no registry to ask (an alias shipped in the image, e.g. smollm2-135m): passed on
  as `--model name`, which the worker resolves itself.

The cache is an emptyDir per pod unless the operator is given a hostPath or a PVC, which pods on
one node (or every node, for a ReadWriteMany claim) share, so the second pod starts without a download.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.api.model_resolution import ResolvedAdapter, ResolvedModel
from inferplane.storage.cache import cached_path
from inferplane.storage.uris import parse_model_uri

MODEL_ROOT = "/models"
CACHE_ROOT = "/model-cache"
ANNOTATION_DIGEST = "inferplane.io/model-digest"
ANNOTATION_VERSION = "inferplane.io/model-version"
ANNOTATION_ADAPTERS = "inferplane.io/adapters"  # name@version:sha256 of each preloaded adapter


@dataclass(frozen=True)
class ModelCache:
    """Where fetched weights live: `host_path` or `claim` (a PVC), else an emptyDir per pod."""

    host_path: str | None = None
    claim: str | None = None
    storage_secret: str | None = None  # a Secret with AWS_* variables for s3:// weights (envFrom)
    s3_endpoint_url: str | None = None

    def volume(self) -> dict[str, Any]:
        if self.claim:
            return {"name": "model-cache", "persistentVolumeClaim": {"claimName": self.claim}}
        if self.host_path:
            return {"name": "model-cache", "hostPath": {"path": self.host_path, "type": "DirectoryOrCreate"}}
        return {"name": "model-cache", "emptyDir": {}}


@dataclass(frozen=True)
class ModelPlan:
    argument: str  # the worker's --model
    volumes: list[dict[str, Any]]
    worker_mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    # LoRA adapters the worker loads before serving (--preload-adapter, fetched by the worker itself
    # into its cache on the tmp volume; their digests annotate the pod, so a new version rolls it).
    adapters: tuple[ResolvedAdapter, ...] = ()


def plan(spec: InferenceDeploymentSpec, model: ResolvedModel | None, *, image: str,
         cache: ModelCache | None = None, adapters: tuple[ResolvedAdapter, ...] = ()) -> ModelPlan:
    weights = _weights(spec, model, image=image, cache=cache)
    if not adapters:
        return weights
    listed = ",".join(f"{a.name}@{a.version}:{a.sha256}" for a in adapters)
    return replace(weights, adapters=tuple(adapters), annotations={**weights.annotations, ANNOTATION_ADAPTERS: listed})


def _weights(spec: InferenceDeploymentSpec, model: ResolvedModel | None, *, image: str,
             cache: ModelCache | None) -> ModelPlan:
    if model is None:
        return _direct(spec)
    cache = cache or ModelCache()
    uri = parse_model_uri(model.uri)
    volumes, mounts = [], []
    if uri.scheme == "pvc":
        # The claim is the storage: mounted read-only, verified in place (nothing is copied).
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": uri.claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_ROOT, "readOnly": True})
        source = f"{MODEL_ROOT}/{uri.path}".rstrip("/")
        argument = source
    else:
        source = model.uri
        argument = str(cached_path(CACHE_ROOT, model.sha256, uri, folder=model.is_folder))
    volumes.append(cache.volume())
    mounts.append({"name": "model-cache", "mountPath": CACHE_ROOT, "readOnly": True})
    return ModelPlan(argument=argument, volumes=volumes, worker_mounts=mounts,
                     init_containers=[_fetch_container(source, model, image=spec.image or image, cache=cache)],
                     annotations={ANNOTATION_DIGEST: model.sha256, ANNOTATION_VERSION: model.version})


def _direct(spec: InferenceDeploymentSpec) -> ModelPlan:
    model = spec.model
    pvc = model.pvc
    if pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": pvc[0], "readOnly": True}}
        argument = f"{MODEL_ROOT}/{pvc[1]}".rstrip("/")
    else:
        volume = {"name": "model", "emptyDir": {}}
        argument = model.name if model.name is not None else str(model.uri)
    return ModelPlan(argument=argument, volumes=[volume],
                     worker_mounts=[{"name": "model", "mountPath": MODEL_ROOT, "readOnly": pvc is not None}])


def _fetch_container(source: str, model: ResolvedModel, *, image: str, cache: ModelCache) -> dict[str, Any]:
    args = ["--uri", source, "--sha256", model.sha256, "--cache-dir", CACHE_ROOT,
            "--termination-log", "/dev/termination-log"]
    if cache.s3_endpoint_url:
        args += ["--s3-endpoint-url", cache.s3_endpoint_url]
    container: dict[str, Any] = {
        "name": "fetch-model",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["inferplane", "fetch-model"],
        "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [{"name": "model-cache", "mountPath": CACHE_ROOT},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    if source.startswith(MODEL_ROOT):
        container["volumeMounts"].append({"name": "model", "mountPath": MODEL_ROOT, "readOnly": True})
    if cache.storage_secret:
        container["envFrom"] = [{"secretRef": {"name": cache.storage_secret}}]
    return container
