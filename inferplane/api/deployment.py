"""The InferenceDeployment spec: parsing, defaults and validation, shared by everything that reads one.

The operator (reconcile and admission webhook), the control plane's local mode and the tests all
read a spec through `InferenceDeploymentSpec.from_dict`, so a spec that one of them accepts every
other accepts too. The CRD's openAPIV3Schema and CEL rules (deploy/crds/) express the same rules
for the API server; the rules a schema cannot express (byte sizes against memory limits, a KV
fraction without a GPU) live only here and reach the cluster through the admission webhook.
Defaults equal the CRD's, so a spec read here matches what the API server stores.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inferplane.api.quantities import KV_CACHE_MEMORY_PATTERN, kv_cache_fraction, parse_bytes, parse_quantity

GROUP = "inferplane.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
API_VERSION = f"{GROUP}/{VERSION}"

RUNTIMES = ("paged", "radix", "cpu-int8", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BLOCK_SIZES = (8, 16, 32, 64, 128)
TIERS = ("primary", "spillover")
CACHE_ISOLATION = ("tenant", "shared")
MODEL_FORMATS = ("safetensors", "gguf")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$")
_URI = re.compile(r"^(/[^\s]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$")


# The fields of each section as users write them (the CRD's properties; a test holds the two equal).
FIELDS: dict[str, tuple[str, ...]] = {
    "": ("model", "runtime", "replicas", "minReplicas", "maxReplicas", "resources", "engine", "serving",
         "autoscaling", "slo", "cacheIsolation", "workload", "image", "drainGraceSeconds", "nodeSelector",
         "tolerations", "affinity"),
    "model": ("name", "version", "uri", "format"),
    "resources": ("gpus", "cpu", "memory", "gpuResourceName"),
    "engine": ("blockSize", "maxNumSeqs", "maxNumBatchedTokens", "kvCacheMemory", "dtype", "maxModelLen",
               "quantizeHead"),
    "serving": ("servedModelName", "weight", "tier"),
    "autoscaling": ("enabled", "targetQueueDepth", "targetKvCacheUtilization", "scaleDownDelaySeconds"),
    "slo": ("ttftP95Seconds", "errorRatePercent", "availability"),
    "workload": ("multiTurn", "sharedPrefix", "agent"),
}


class SpecError(ValueError):
    """An invalid spec; `field` is the dotted path of the offending field, as users write it."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"spec.{field_path}: {message}")
        self.field = field_path
        self.reason = message


def _known_fields(data: Mapping[str, Any], section: str) -> None:
    """A field nobody reads is refused, not ignored: a typo (`replica: 3`) must not pass silently."""
    unknown = sorted(str(key) for key in data if key not in FIELDS[section])
    if unknown:
        where = f"{section}.{unknown[0]}" if section else unknown[0]
        raise SpecError(where, f"unknown field; {section or 'spec'} has {', '.join(FIELDS[section])}")


def _get(data: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """Read one field, checking its JSON type; bool is rejected where a number is expected."""
    value = data.get(key, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise SpecError(path, f"expected {kinds[0].__name__}, got a boolean")
    if not isinstance(value, kinds):
        raise SpecError(path, f"expected {kinds[0].__name__}, got {type(value).__name__}")
    return value


def _bounded(value: int | float | None, path: str, low: float | None = None, high: float | None = None) -> None:
    if value is None:
        return
    if low is not None and value < low:
        raise SpecError(path, f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise SpecError(path, f"must be at most {high}, got {value}")


def _enum(value: Any, path: str, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise SpecError(path, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(frozen=True)
class ModelRef:
    """Either a registry entry (`name`, optional `version`) or weights at `uri` in a known `format`."""

    name: str | None = None
    version: str | None = None
    uri: str | None = None
    format: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelRef:
        _known_fields(data, "model")
        name = _get(data, "name", "model.name", str)
        version = _get(data, "version", "model.version", (str, int))
        uri = _get(data, "uri", "model.uri", str)
        fmt = _get(data, "format", "model.format", str)
        if (name is None) == (uri is None):
            raise SpecError("model", "set exactly one of model.name (a registry entry) or model.uri (a path)")
        if name is not None and not _NAME.match(name):
            raise SpecError("model.name", f"{name!r} is not a registry name (lowercase letters, digits, '-._')")
        if uri is not None:
            if not _URI.match(uri):
                raise SpecError("model.uri", f"{uri!r} must be an absolute path or pvc://<claim>/<path>")
            if fmt is None:
                raise SpecError("model.format", "is required with model.uri (safetensors or gguf)")
            _enum(fmt, "model.format", MODEL_FORMATS)
        elif fmt is not None:
            _enum(fmt, "model.format", MODEL_FORMATS)
        return cls(name=name, version=None if version is None else str(version), uri=uri, format=fmt)

    @property
    def pvc(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for pvc:// URIs, else None."""
        if self.uri is None or not self.uri.startswith("pvc://"):
            return None
        claim, _, rest = self.uri.removeprefix("pvc://").partition("/")
        return claim, rest


@dataclass(frozen=True)
class Resources:
    gpus: int = 0
    cpu: str = "2"
    memory: str = "8Gi"
    gpu_resource_name: str = "nvidia.com/gpu"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Resources:
        _known_fields(data, "resources")
        gpus = _get(data, "gpus", "resources.gpus", int, 0)
        _bounded(gpus, "resources.gpus", 0, 8)
        cpu = str(_get(data, "cpu", "resources.cpu", (str, int, float), "2"))
        memory = str(_get(data, "memory", "resources.memory", (str, int), "8Gi"))
        for path, value in (("resources.cpu", cpu), ("resources.memory", memory)):
            try:
                if parse_quantity(value) <= 0:
                    raise SpecError(path, f"must be positive, got {value!r}")
            except ValueError as exc:
                if isinstance(exc, SpecError):
                    raise
                raise SpecError(path, f"{value!r} is not a Kubernetes quantity (like 2, 500m, 8Gi)") from exc
        gpu_name = _get(data, "gpuResourceName", "resources.gpuResourceName", str, "nvidia.com/gpu")
        return cls(gpus=gpus, cpu=cpu, memory=memory, gpu_resource_name=gpu_name)


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs; None means "the runtime preset decides" (see inferplane.api.selection)."""

    block_size: int = 16
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    quantize_head: bool = False  # cpu-int8: the output head in int8 too

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        _known_fields(data, "engine")
        block_size = _get(data, "blockSize", "engine.blockSize", int, 16)
        _enum(block_size, "engine.blockSize", BLOCK_SIZES)
        max_num_seqs = _get(data, "maxNumSeqs", "engine.maxNumSeqs", int)
        _bounded(max_num_seqs, "engine.maxNumSeqs", 1, 4096)
        max_tokens = _get(data, "maxNumBatchedTokens", "engine.maxNumBatchedTokens", int)
        _bounded(max_tokens, "engine.maxNumBatchedTokens", 16, 1_048_576)
        kv = _get(data, "kvCacheMemory", "engine.kvCacheMemory", (str, float, int))
        if kv is not None:
            kv = str(kv)
            if not re.match(KV_CACHE_MEMORY_PATTERN, kv):
                raise SpecError("engine.kvCacheMemory",
                                f"{kv!r} must be a byte size like 2GiB or a fraction of free GPU memory like 0.9")
        dtype = _get(data, "dtype", "engine.dtype", str, "auto")
        _enum(dtype, "engine.dtype", DTYPES)
        max_model_len = _get(data, "maxModelLen", "engine.maxModelLen", int)
        _bounded(max_model_len, "engine.maxModelLen", 16, 1_048_576)
        quantize_head = _get(data, "quantizeHead", "engine.quantizeHead", bool, False)
        if max_tokens is not None and max_num_seqs is not None and max_tokens < max_num_seqs:
            raise SpecError("engine.maxNumBatchedTokens",
                            f"({max_tokens}) must be at least engine.maxNumSeqs ({max_num_seqs}): "
                            "every running sequence needs one token per step")
        return cls(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                   kv_cache_memory=kv, dtype=dtype, max_model_len=max_model_len, quantize_head=quantize_head)


@dataclass(frozen=True)
class Serving:
    served_model_name: str | None = None
    weight: int = 100
    tier: str = "primary"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Serving:
        _known_fields(data, "serving")
        name = _get(data, "servedModelName", "serving.servedModelName", str)
        if name is not None and not (1 <= len(name) <= 128):
            raise SpecError("serving.servedModelName", "must be 1 to 128 characters")
        weight = _get(data, "weight", "serving.weight", int, 100)
        _bounded(weight, "serving.weight", 0, 100)
        tier = _get(data, "tier", "serving.tier", str, "primary")
        _enum(tier, "serving.tier", TIERS)
        return cls(served_model_name=name, weight=weight, tier=tier)


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    target_queue_depth: float = 4.0
    target_kv_cache_utilization: float = 0.8
    scale_down_delay_seconds: int = 300

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Autoscaling:
        _known_fields(data, "autoscaling")
        enabled = _get(data, "enabled", "autoscaling.enabled", bool, False)
        queue = float(_get(data, "targetQueueDepth", "autoscaling.targetQueueDepth", (int, float), 4.0))
        _bounded(queue, "autoscaling.targetQueueDepth", 0.1, 10_000)
        kv = float(_get(data, "targetKvCacheUtilization", "autoscaling.targetKvCacheUtilization", (int, float), 0.8))
        _bounded(kv, "autoscaling.targetKvCacheUtilization", 0.05, 1.0)
        delay = _get(data, "scaleDownDelaySeconds", "autoscaling.scaleDownDelaySeconds", int, 300)
        _bounded(delay, "autoscaling.scaleDownDelaySeconds", 0, 86_400)
        return cls(enabled=enabled, target_queue_depth=queue, target_kv_cache_utilization=kv,
                   scale_down_delay_seconds=delay)


@dataclass(frozen=True)
class SLO:
    ttft_p95_seconds: float = 2.0
    error_rate_percent: float = 1.0
    availability: float = 99.5

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SLO:
        _known_fields(data, "slo")
        ttft = float(_get(data, "ttftP95Seconds", "slo.ttftP95Seconds", (int, float), 2.0))
        _bounded(ttft, "slo.ttftP95Seconds", 0.001, 600)
        err = float(_get(data, "errorRatePercent", "slo.errorRatePercent", (int, float), 1.0))
        _bounded(err, "slo.errorRatePercent", 0, 100)
        avail = float(_get(data, "availability", "slo.availability", (int, float), 99.5))
        _bounded(avail, "slo.availability", 0, 100)
        return cls(ttft_p95_seconds=ttft, error_rate_percent=err, availability=avail)


@dataclass(frozen=True)
class WorkloadHints:
    """What the traffic looks like; `runtime: auto` picks from these (see selection.py)."""

    multi_turn: bool = False
    shared_prefix: bool = False
    agent: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkloadHints:
        _known_fields(data, "workload")
        return cls(**{
            attr: _get(data, key, f"workload.{key}", bool, False)
            for attr, key in (("multi_turn", "multiTurn"), ("shared_prefix", "sharedPrefix"),
                              ("agent", "agent"))
        })


@dataclass(frozen=True)
class InferenceDeploymentSpec:
    model: ModelRef
    runtime: str = "auto"
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    resources: Resources = field(default_factory=Resources)
    engine: EngineConfig = field(default_factory=EngineConfig)
    serving: Serving = field(default_factory=Serving)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    slo: SLO = field(default_factory=SLO)
    cache_isolation: str = "tenant"
    workload: WorkloadHints = field(default_factory=WorkloadHints)
    image: str | None = None
    drain_grace_seconds: int = 30
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> InferenceDeploymentSpec:
        """Parse and validate a spec; raises SpecError naming the first offending field."""
        if not isinstance(data, Mapping):
            raise SpecError("model", "the spec is empty; at least spec.model is required")
        if not isinstance(data.get("model"), Mapping):
            raise SpecError("model", "is required: {name: <registry name>} or {uri: <path>, format: <format>}")
        _known_fields(data, "")

        def section(key: str) -> Mapping[str, Any]:
            value = data.get(key) or {}
            if not isinstance(value, Mapping):
                raise SpecError(key, f"expected an object, got {type(value).__name__}")
            return value

        runtime = _get(data, "runtime", "runtime", str, "auto")
        _enum(runtime, "runtime", RUNTIMES)
        replicas = _get(data, "replicas", "replicas", int, 1)
        _bounded(replicas, "replicas", 0, 1000)
        min_replicas = _get(data, "minReplicas", "minReplicas", int, 1)
        _bounded(min_replicas, "minReplicas", 0, 1000)
        max_replicas = _get(data, "maxReplicas", "maxReplicas", int, max(replicas, min_replicas))
        _bounded(max_replicas, "maxReplicas", 1, 1000)
        if min_replicas > max_replicas:
            raise SpecError("minReplicas", f"({min_replicas}) must not exceed maxReplicas ({max_replicas})")
        if not min_replicas <= replicas <= max_replicas:
            raise SpecError("replicas", f"({replicas}) must lie within minReplicas..maxReplicas "
                                        f"({min_replicas}..{max_replicas})")
        resources = Resources.from_dict(section("resources"))
        engine = EngineConfig.from_dict(section("engine"))
        cache_isolation = _get(data, "cacheIsolation", "cacheIsolation", str, "tenant")
        _enum(cache_isolation, "cacheIsolation", CACHE_ISOLATION)
        drain = _get(data, "drainGraceSeconds", "drainGraceSeconds", int, 30)
        _bounded(drain, "drainGraceSeconds", 0, 3600)
        spec = cls(
            model=ModelRef.from_dict(section("model")), runtime=runtime, replicas=replicas,
            min_replicas=min_replicas, max_replicas=max_replicas, resources=resources, engine=engine,
            serving=Serving.from_dict(section("serving")), autoscaling=Autoscaling.from_dict(section("autoscaling")),
            slo=SLO.from_dict(section("slo")), cache_isolation=cache_isolation,
            workload=WorkloadHints.from_dict(section("workload")), image=_get(data, "image", "image", str),
            drain_grace_seconds=drain,
            node_selector=dict(section("nodeSelector")),
            tolerations=list(_get(data, "tolerations", "tolerations", list, [])),
            affinity=dict(section("affinity")),
        )
        spec._check_cross_field()
        return spec

    def _check_cross_field(self) -> None:
        """Rules spanning sections; the last two are beyond what the CRD's schema and CEL can express."""
        if self.runtime == "cpu-int8" and self.resources.gpus > 0:
            raise SpecError("resources.gpus", "runtime cpu-int8 runs on CPU; set resources.gpus to 0 "
                                              "or choose runtime paged, radix or auto")
        if self.runtime == "cpu-int8" and self.engine.dtype not in ("auto", "float32"):
            raise SpecError("engine.dtype", f"runtime cpu-int8 computes in float32; got {self.engine.dtype}")
        if self.engine.quantize_head and self.runtime in ("paged", "radix"):
            raise SpecError("engine.quantizeHead", "a cpu-int8 option (runtime cpu-int8 or auto)")
        if self.resources.gpus == 0 and self.engine.dtype == "float16":
            raise SpecError("engine.dtype", "float16 needs a GPU (resources.gpus > 0); use float32 or bfloat16")
        kv = self.engine.kv_cache_memory
        if kv is None:
            return
        if kv_cache_fraction(kv) is not None:
            if self.resources.gpus == 0:
                raise SpecError("engine.kvCacheMemory", f"{kv} is a fraction of free GPU memory, but "
                                                        "resources.gpus is 0; give a byte size such as 2GiB")
            return
        if self.resources.gpus == 0:
            kv_bytes, limit = parse_bytes(kv), parse_quantity(self.resources.memory)
            if kv_bytes >= limit:
                raise SpecError("engine.kvCacheMemory",
                                f"{kv} does not fit in resources.memory ({self.resources.memory}), which on a "
                                "CPU worker must also hold the weights")

    @property
    def uses_gpu(self) -> bool:
        return self.resources.gpus > 0

    def served_model_name(self, resource_name: str) -> str:
        """What tenants ask for: serving.servedModelName, else the registry name, else the resource name."""
        return self.serving.served_model_name or self.model.name or resource_name
