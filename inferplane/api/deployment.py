"""The InferenceDeployment spec as typed models: the one home of its fields, defaults, bounds and rules.

Everything that reads a spec (the operator's reconcile and admission webhook, the cluster gateway's
sync, local mode, tests) goes through `InferenceDeploymentSpec.from_dict`, and the CRD's
openAPIV3Schema is generated from these models (`inferplane crd`, see api/crd.py), so a field, its
default or its bound is written once and the API server and Python cannot disagree about it.

Cross-field rules are declared once in `RULES`, each with its CEL form (the API server checks it)
and its Python form (the webhook and local mode check it); the rules CEL cannot express (byte sizes
against memory limits, a KV fraction without a GPU) have no CEL and reach a cluster through the
operator's admission webhook. Null values are dropped before validation, as the API server prunes
them before defaulting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from inferplane.api.architectures import ModelKind
from inferplane.api.priority import Band
from inferplane.api.quantities import (
    BYTES_PATTERN,
    KV_CACHE_MEMORY_PATTERN,
    kv_cache_fraction,
    parse_bytes,
    parse_quantity,
)

GROUP = "inferplane.io"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
API_VERSION = f"{GROUP}/{VERSION}"

# The runtimes a worker runs (each one preset in api/resolve.py); `auto` lets resolve() choose.
# paged, radix and cpu-int8 generate; embedding serves embedding models (spec.kind: embedding).
ConcreteRuntime = Literal["paged", "radix", "cpu-int8", "embedding"]
Runtime = Literal[ConcreteRuntime, "auto"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]
Dtype = Literal["auto", ComputeDtype]  # auto: resolve() picks by device (a KV cache: the compute dtype)
RUNTIMES: tuple[str, ...] = Runtime.__args__
COMPUTE_DTYPES: tuple[str, ...] = ComputeDtype.__args__

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$"
URI_PATTERN = r"^(/[^\s]*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^\s]*)?)$"
CPU_PATTERN = r"^[0-9]+(\.[0-9]+)?m?$"
MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|K|M|G|T)?$"
# What a user is told when a value misses its pattern (a regex is no explanation).
PATTERN_HINTS = {
    NAME_PATTERN: "is not a registry name (lowercase letters, digits, '-._')",
    URI_PATTERN: "must be an absolute path or pvc://<claim>/<path>",
    CPU_PATTERN: "is not a CPU quantity (like 2, 0.5 or 500m)",
    MEMORY_PATTERN: "is not a memory quantity (like 8Gi or 512Mi)",
    KV_CACHE_MEMORY_PATTERN: "must be a byte size like 2GiB or a fraction of free GPU memory like 0.9",
    BYTES_PATTERN: "must be a byte size like 2GiB or 512Mi",
}


def _number_as_text(value: Any) -> Any:
    """YAML reads `version: 2` or `cpu: 4` as numbers; the spec keeps them as the text the user meant."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def number_as_text(*constraints: Any) -> Any:
    """A string field that also takes a number (made text) and keeps its constraints in the schema.

    The conversion goes last in the metadata so that pydantic validates (and writes into the JSON
    schema) the constraints on the string it produced.
    """
    return Annotated[str, *constraints, BeforeValidator(_number_as_text)]


# Kubernetes quantities may be written as numbers or strings (x-kubernetes-int-or-string).
_INT_OR_STRING = Field(json_schema_extra={"x-kubernetes-int-or-string": True})


class SpecError(ValueError):
    """An invalid spec; `field` is the dotted path of the offending field, as users write it."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"spec.{field_path}: {message}")
        self.field = field_path
        self.reason = message


class Section(BaseModel):
    """A part of the spec: camelCase as users write it, strict JSON types, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
                              strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {key: value for key, value in data.items() if value is not None}
        return data


def section_default(description: str | None = None) -> Any:
    """A section that may be left out: the API server defaults it to {} so that its fields default too."""
    return Field(default_factory=dict, validate_default=True, description=description,
                 json_schema_extra={"default": {}})


class ModelRef(Section):
    """Either a registry entry (`name`, optional `version`) or weights at `uri` in a known `format`."""

    name: Annotated[str, Field(max_length=253, pattern=NAME_PATTERN)] | None = None
    version: number_as_text(Field(max_length=63)) | None = None
    uri: Annotated[str, Field(max_length=1024, pattern=URI_PATTERN, description=(
        "An absolute path inside the worker image, or pvc://<claim>/<path>."))] | None = None
    format: Literal["safetensors", "gguf"] | None = None

    @property
    def pvc(self) -> tuple[str, str] | None:
        """(claim, path inside the claim) for pvc:// URIs, else None."""
        if self.uri is None or not self.uri.startswith("pvc://"):
            return None
        claim, _, rest = self.uri.removeprefix("pvc://").partition("/")
        return claim, rest


class AdapterRef(Section):
    """A LoRA adapter of the registry to load at start (the latest verified version, or `version`)."""

    name: Annotated[str, Field(max_length=253, pattern=NAME_PATTERN)]
    version: number_as_text(Field(max_length=63)) | None = None


class Resources(Section):
    gpus: Annotated[int, Field(ge=0, le=8)] = 0
    gpu_resource_name: str = "nvidia.com/gpu"
    cpu: number_as_text(Field(pattern=CPU_PATTERN), _INT_OR_STRING) = "2"
    memory: number_as_text(Field(pattern=MEMORY_PATTERN), _INT_OR_STRING) = "8Gi"


SPECULATIVE_METHODS = ("ngram", "suffix")


class Speculative(Section):
    """Speculative decoding: tokens proposed from text the request (or its tenant) already wrote,
    verified several at a time in one forward; the output is the same tokens as without it."""

    method: Literal[SPECULATIVE_METHODS] = Field(description=(
        "ngram: proposals from the request's own prompt and output (prompt lookup). suffix: from those "
        "and the same tenant's recent requests to this deployment under the same adapter (never another "
        "tenant's)."))
    num_tokens: int = Field(5, ge=1, le=16, description=(
        "Tokens proposed at most per step; each request proposes fewer (or, for a while, none) as its "
        "proposals miss."))


class EngineConfig(Section):
    """Engine knobs; None means "the runtime preset decides" (see inferplane.api.resolve)."""

    block_size: Literal[8, 16, 32, 64, 128] = 16
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=16, le=1_048_576)] | None = None
    kv_cache_memory: number_as_text(Field(pattern=KV_CACHE_MEMORY_PATTERN, description=(
        "Bytes (2GiB) or a fraction of free GPU memory (0.9)."))) | None = None
    dtype: Dtype = "auto"
    kv_cache_dtype: Dtype = Field("auto", description=(
        "What the KV cache stores. auto: the runtime's choice, float16 on cpu-int8 (as llama.cpp), "
        "else the compute dtype. float16 under float32 compute (the CPU runtimes) halves the KV "
        "memory and the bytes each decode step reads."))
    max_model_len: Annotated[int, Field(ge=16, le=1_048_576)] | None = None
    quantize_head: bool | None = Field(None, description=(
        "cpu-int8 only. The output head in int8 (unset: the runtime's default, int8); false keeps it "
        "float32 (slower at small batches, closest to the file's head)."))
    requantize_q4: bool = Field(False, description=(
        "cpu-int8 only. Requantize a GGUF file's 4-, 5-, 6- and 8-bit weights (Q4_0/Q4_1/Q4_K, Q5_0/Q5_1/Q5_K, "
        "Q6_K, Q8_0) to per-channel int8 instead of serving the file's own blocks (the default)."))
    max_loras: int = Field(0, ge=0, le=256, description=(
        "LoRA adapters a replica holds at once (slots, loaded and evicted least recently used at request "
        "time); rows of different adapters and of the base share each batch. 0: no adapters."))
    max_lora_rank: int = Field(16, ge=1, le=512, description=(
        "The largest adapter rank a slot holds; an adapter of a higher rank is refused."))
    decode_steps: Annotated[int, Field(ge=1, le=64)] | None = Field(None, description=(
        "cpu-int8 only. Greedy decode steps run in one call while every running request decodes "
        "greedily past its first token (no sampling, penalties, logit bias, minTokens, grammar, logprobs "
        "or LoRA adapter; stop strings only alone) and none waits to be admitted; tokens stream in bursts "
        "of up to this many, and a request arriving meanwhile waits at most that many steps. 1: one step "
        "per scheduling round. Unset: the runtime's preset (8 on cpu-int8)."))
    kv_offload_memory: number_as_text(Field(pattern=BYTES_PATTERN, description=(
        "KV tiers, host memory: KV blocks that leave the pool are kept here (least recently used out) "
        "and read back instead of computed again when their conversation returns. Counted in the "
        "worker's memory (resources.memory) before the KV pool. Needs the radix KV manager (runtime "
        "radix or cpu-int8; auto picks one)."))) | None = None
    kv_offload_disk: number_as_text(Field(pattern=BYTES_PATTERN, description=(
        "KV tiers, disk: below the memory tier, in a volume the operator mounts (an emptyDir of this "
        "size, requested as ephemeral storage); it outlives a crashed worker process, and a new worker "
        "of the same model and settings reads what it finds there. Needs the radix KV manager."))) | None = None
    kv_events: bool | None = Field(None, description=(
        "Publish which KV blocks each worker holds, in its pool and each KV tier (vLLM's KV events: "
        "BlockStored, BlockRemoved, AllBlocksCleared), over a gRPC stream the gateway reads for "
        "kv-aware routing. Unset: on with the radix KV manager (runtime radix or cpu-int8); true "
        "needs it."))
    speculative: Speculative | None = Field(None, description=(
        "Speculative decoding (unset: off): for text that repeats what the context holds (code edits, "
        "answers quoting their sources, agents echoing tool output), several tokens per forward."))
    enforce_eager: bool = Field(False, description=(
        "GPU only. Run decode steps kernel by kernel instead of replaying CUDA graphs (one captured "
        "per batch-size bucket up to maxNumSeqs); the graphs' memory is counted before the KV pool "
        "is sized. For debugging and for comparing."))


class Serving(Section):
    served_model_name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    weight: int = Field(100, ge=0, le=100, description=(
        "Share of the served model's traffic (A/B split across deployments)."))
    tier: Literal["primary", "spillover"] = "primary"


RoutingPolicy = Literal["kv-aware", "prefix-hash", "least-loaded"]


class Routing(Section):
    """How the gateway picks one of the deployment's replicas for a request."""

    policy: RoutingPolicy | None = Field(None, description=(
        "kv-aware: the replica holding the longest run of the prompt's leading KV blocks (in its pool, "
        "then its memory tier, then its disk tier, as the workers' KV events report), within bounded "
        "load; a prompt no replica holds goes as prefix-hash sends it (needs KV events). prefix-hash: a "
        "hash ring over the prompt's first blocks, under bounded load. least-loaded: the fewest requests "
        "in flight. Unset: kv-aware where KV tiers (engine.kvOffload*) and KV events are on, else "
        "prefix-hash."))


class Autoscaling(Section):
    """Knative-style: replicas follow the saturation averaged over a stable window, with a short
    panic window for bursts (see inferplane.control_plane.autoscale)."""

    enabled: bool = False
    target_queue_depth: float = Field(4.0, ge=0.1, le=10_000, description=(
        "Requests waiting per replica that count as one replica's worth of load."))
    target_kv_cache_utilization: float = Field(0.8, ge=0.05, le=1.0, description=(
        "KV-cache use (reclaimable cached blocks count as free) that counts as one replica's worth of load."))
    scale_down_delay_seconds: int = Field(300, ge=0, le=86_400, description=(
        "Replicas go down only to the highest count wanted over this many seconds."))
    stable_window_seconds: int = Field(60, ge=6, le=3600)
    panic_window_seconds: int = Field(6, ge=1, le=600, description=(
        "Bursts: when this window asks for panicThreshold times the replicas, scale up at once and not down."))
    panic_threshold: float = Field(2.0, ge=1.1, le=100)
    tolerance: float = Field(0.1, ge=0, le=0.9, description=(
        "No change while within this fraction of the current count."))
    max_scale_up_rate: float = Field(10.0, ge=1.1, le=1000, description=(
        "At most this many times the current replicas in one step."))
    idle_seconds: int = Field(300, ge=0, le=86_400, description=(
        "With minReplicas 0: no request for this long scales the deployment to zero."))
    queue_size: int = Field(100, ge=0, le=100_000, description=(
        "Requests the gateway holds while a deployment at zero replicas starts one."))
    queue_timeout_seconds: float = Field(60.0, ge=1, le=3600, description=(
        "How long a held request waits for a replica before a 503 with Retry-After."))


class SLO(Section):
    ttft_p95_seconds: float = Field(2.0, ge=0.001, le=600)
    error_rate_percent: float = Field(1.0, ge=0, le=100)
    availability: float = Field(99.5, ge=0, le=100)


class WorkloadHints(Section):
    """What the traffic looks like; `runtime: auto` picks from these (see api/resolve.py)."""

    multi_turn: bool = False
    shared_prefix: bool = False
    agent: bool = False


def default_max_replicas(section: type[Section], data: Any) -> Any:
    """`data` with maxReplicas filled in where it is left out: max(replicas, minReplicas), each as
    given or the section's default, and at least 1, its own lower bound (so that replicas 0 with
    minReplicas 0, which the API server accepts, is not refused for a field the user left out).
    Filled in before validation: the CRD cannot default one field from two others, so it has no
    default, and the rules read an absent maxReplicas as no bound."""
    if not isinstance(data, Mapping) or data.get("maxReplicas", data.get("max_replicas")) is not None:
        return data
    counts = [data.get(key, section.model_fields[name].default)
              for name, key in (("replicas", "replicas"), ("min_replicas", "minReplicas"))]
    if all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        return {**data, "maxReplicas": max(*counts, 1)}
    return data  # a wrong type fails its own field's validation


def prefill_pool_name(name: str) -> str:
    """The prefill pool of the InferenceDeployment `name`: its Deployment, headless Service and
    PodDisruptionBudget in a cluster (operator/manifests.py), its processes under `inferplane up`."""
    return f"{name}-prefill"


class PrefillPool(Section):
    """The prefill pool of a disaggregated deployment: its own Deployment of workers (<name>-prefill)."""

    replicas: int = Field(1, ge=0, le=1000, description=(
        "Prefill workers. 0: every decode replica computes its prompts itself."))
    min_replicas: int = Field(1, ge=0, le=1000)
    # Left out, it is max(replicas, minReplicas), as the spec's own maxReplicas.
    max_replicas: Annotated[int, Field(ge=1, le=1000)] | None = None
    resources: Resources | None = Field(None, description=(
        "Each prefill worker's resources; unset: the same as spec.resources (set, the fields it leaves "
        "out take their usual defaults). GPUs or not as spec.resources: a decode worker reads the KV a "
        "prefill worker computed, in the same layout."))

    @model_validator(mode="before")
    @classmethod
    def _default_max_replicas(cls, data: Any) -> Any:
        return default_max_replicas(cls, data)


class Disaggregation(Section):
    """Prefill/decode disaggregation: prompts computed by a pool of their own, tokens generated by the
    deployment's replicas (the decode pool), as llm-d does."""

    enabled: bool = False
    prefill: PrefillPool = section_default()
    min_prefill_tokens: int = Field(512, ge=0, le=1_048_576, description=(
        "Prompt tokens not already cached on the chosen decode replica from which a request's prompt is "
        "computed by the prefill pool; below it the decode replica computes it itself (llm-d's decider). "
        "0: every request goes through the prefill pool."))


class Toleration(Section):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class InferenceDeploymentSpec(Section):
    model: ModelRef = Field(description="A registry entry (name, version) or weights at a path (uri, format).")
    # The spec says it: resolve() never reads weights, and `auto` must know which runtimes apply.
    kind: ModelKind = Field("generate", description=(
        "generate: chat and completions. embedding: an encoder model (BERT family) serving /v1/embeddings, in "
        "runtime embedding (auto picks it); generation-only settings are refused."))
    runtime: Runtime = "auto"
    replicas: int = Field(1, ge=0, le=1000)
    min_replicas: int = Field(1, ge=0, le=1000)
    # Left out, it is max(replicas, minReplicas) (default_max_replicas; the CRD has no default).
    max_replicas: Annotated[int, Field(ge=1, le=1000)] | None = None
    resources: Resources = section_default()
    engine: EngineConfig = section_default("Unset fields take the runtime preset's value.")
    serving: Serving = section_default()
    routing: Routing = section_default()
    autoscaling: Autoscaling = section_default()
    slo: SLO = section_default()
    disaggregation: Disaggregation = section_default(
        "Prefill/decode disaggregation: a prefill pool computes prompts and keeps their KV, which the "
        "decode replica (replicas, resources and autoscaling above describe the decode pool) pulls "
        "instead of computing it; see docs/disaggregation.md.")
    cache_isolation: Literal["tenant", "shared"] = Field("tenant", description=(
        "tenant keeps each tenant's cached prefixes apart; shared reuses them across tenants, only if every "
        "deployment with the same served name is shared."))
    priority: Band | None = Field(None, description=(
        "The priority band of this model's requests whose API key and tenant set none (unset: standard). "
        "A replica admits the most urgent band first and, short of room, preempts the least urgent first."))
    workload: WorkloadHints = section_default("Traffic hints that runtime auto chooses from.")
    tenant: Annotated[str, Field(pattern=r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")] | None = Field(
        None, description="The tenant that owns this deployment: its alerts carry this tenant label and reach "
                          "that tenant's alert webhooks.")
    adapters: list[AdapterRef] = Field(default_factory=list, max_length=64, description=(
        "LoRA adapters (registry entries bound to this deployment's model) every replica loads before it "
        "serves; others load on their first request. Needs engine.maxLoras at least this many."))
    image: Annotated[str, Field(max_length=512)] | None = None
    drain_grace_seconds: int = Field(30, ge=0, le=3600)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict,
                                     json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    @model_validator(mode="before")
    @classmethod
    def _default_max_replicas(cls, data: Any) -> Any:
        return default_max_replicas(cls, data)

    @model_validator(mode="after")
    def _check_rules(self) -> InferenceDeploymentSpec:
        for rule in RULES:
            if not rule.holds(self):
                raise PydanticCustomError("spec_rule", "{reason}", {"field": rule.field, "reason": rule.message})
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> InferenceDeploymentSpec:
        """Parse and validate a spec; raises SpecError naming the first offending field."""
        if not isinstance(data, Mapping) or not data:
            raise SpecError("model", "the spec is empty; at least spec.model is required")
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise spec_error(exc) from None

    @property
    def uses_gpu(self) -> bool:
        return self.resources.gpus > 0

    def served_model_name(self, resource_name: str) -> str:
        """What tenants ask for: serving.servedModelName, else the registry name, else the resource name."""
        return self.serving.served_model_name or self.model.name or resource_name


@dataclass(frozen=True)
class Rule:
    """One rule across fields, written once: CEL for the API server, Python for the webhook and local mode.

    `scope` is the section whose CEL `self` the rule sees ("" is the spec); `field` is the dotted
    path (from spec) an error names. A rule without CEL is beyond what CEL can say; the admission
    webhook enforces it in a cluster.
    """

    scope: str
    field: str
    message: str
    holds: Callable[[InferenceDeploymentSpec], bool]
    cel: str | None = None


# The smallest resources.memory a worker can start in (api.footprint.RUNTIME_BYTES, the process
# before any model, and room for the smallest one); what a model needs beyond it, the worker checks
# at start against its own footprint (worker/serve/footprint.py), since the spec does not say the model's size.
MIN_WORKER_MEMORY = "1536Mi"


def _is_embedding(spec: InferenceDeploymentSpec) -> bool:
    return spec.kind == "embedding"


def _kv_fraction_has_gpu(spec: InferenceDeploymentSpec) -> bool:
    kv = spec.engine.kv_cache_memory
    return kv is None or kv_cache_fraction(kv) is None or spec.uses_gpu


def _kv_bytes_fit_memory(spec: InferenceDeploymentSpec) -> bool:
    kv = spec.engine.kv_cache_memory
    if kv is None or kv_cache_fraction(kv) is not None or spec.uses_gpu:
        return True
    return parse_bytes(kv) < parse_quantity(spec.resources.memory)


def _resource_rules(path: str, resources: Callable[[InferenceDeploymentSpec], Resources | None]
                    ) -> tuple[Rule, ...]:
    """The rules on a pool's resources (`path`, as users write it; None: unset, nothing to check)
    that CEL cannot say, quantities compared as numbers: spec.resources' and the prefill pool's."""
    def check(holds: Callable[[Resources], bool]) -> Callable[[InferenceDeploymentSpec], bool]:
        return lambda s: (given := resources(s)) is None or holds(given)

    return (
        Rule("", f"{path}.cpu", "must be a positive quantity", check(lambda r: parse_quantity(r.cpu) > 0)),
        Rule("", f"{path}.memory", "must be a positive quantity", check(lambda r: parse_quantity(r.memory) > 0)),
        Rule("", f"{path}.memory", f"must be at least {MIN_WORKER_MEMORY}: a worker process takes about 1 GiB "
             "before its model (api/footprint.py); the worker checks the rest against its model at start",
             check(lambda r: parse_quantity(r.memory) >= parse_quantity(MIN_WORKER_MEMORY))),
    )


def _prefill(spec: InferenceDeploymentSpec) -> PrefillPool:
    return spec.disaggregation.prefill


RULES: tuple[Rule, ...] = (
    Rule("model", "model", "set exactly one of model.name (a registry entry) or model.uri (a path)",
         lambda s: (s.model.name is None) != (s.model.uri is None),
         cel="has(self.name) != has(self.uri)"),
    Rule("model", "model.format", "model.format is required with model.uri (safetensors or gguf)",
         lambda s: s.model.uri is None or s.model.format is not None,
         cel="!has(self.uri) || has(self.format)"),
    Rule("", "minReplicas", "minReplicas must not exceed maxReplicas",
         lambda s: s.max_replicas is None or s.min_replicas <= s.max_replicas,
         cel="!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas"),
    Rule("", "replicas", "replicas must lie within minReplicas..maxReplicas",
         lambda s: s.min_replicas <= s.replicas and (s.max_replicas is None or s.replicas <= s.max_replicas),
         cel="self.replicas >= self.minReplicas && (!has(self.maxReplicas) || self.replicas <= self.maxReplicas)"),
    Rule("", "resources.gpus", "runtime cpu-int8 runs on CPU; set resources.gpus to 0 or choose paged, radix or auto",
         lambda s: not (s.runtime == "cpu-int8" and s.resources.gpus > 0),
         cel="!(self.runtime == 'cpu-int8' && self.resources.gpus > 0)"),
    Rule("", "engine.dtype", "runtime cpu-int8 computes in float32",
         lambda s: not (s.runtime == "cpu-int8" and s.engine.dtype in ("bfloat16", "float16")),
         cel="!(self.runtime == 'cpu-int8' && self.engine.dtype in ['bfloat16', 'float16'])"),
    Rule("", "engine.quantizeHead", "engine.quantizeHead is a cpu-int8 option (runtime cpu-int8 or auto)",
         lambda s: not (s.engine.quantize_head is not None and s.runtime in ("paged", "radix")),
         cel="!(has(self.engine.quantizeHead) && self.runtime in ['paged', 'radix'])"),
    Rule("", "engine.decodeSteps", "engine.decodeSteps is a cpu-int8 option (runtime cpu-int8 or auto)",
         lambda s: not (s.engine.decode_steps is not None and s.runtime in ("paged", "radix")),
         cel="!(has(self.engine.decodeSteps) && self.runtime in ['paged', 'radix'])"),
    Rule("", "engine.requantizeQ4", "engine.requantizeQ4 is a cpu-int8 option (runtime cpu-int8 or auto)",
         lambda s: not (s.engine.requantize_q4 and s.runtime in ("paged", "radix")),
         cel="!(self.engine.requantizeQ4 && self.runtime in ['paged', 'radix'])"),
    # An embedding model runs in the embedding runtime only, and that runtime serves nothing else.
    Rule("", "runtime", "kind embedding runs in runtime embedding (or auto, which picks it)",
         lambda s: not _is_embedding(s) or s.runtime in ("embedding", "auto"),
         cel="self.kind != 'embedding' || self.runtime in ['embedding', 'auto']"),
    Rule("", "kind", "runtime embedding serves embedding models; set kind: embedding",
         lambda s: s.runtime != "embedding" or _is_embedding(s),
         cel="self.runtime != 'embedding' || self.kind == 'embedding'"),
    # Generation-only settings on an embedding deployment: it has no KV cache (one forward per batch,
    # nothing kept), no output head and no 4-bit GGUF weights, and its traffic shares no prefixes.
    # maxNumSeqs (inputs per forward), maxNumBatchedTokens (padded tokens per forward), dtype and
    # maxModelLen keep a meaning there and stay allowed.
    Rule("", "engine.kvCacheMemory",
         "engine.kvCacheMemory is a generation setting; an embedding model keeps no KV cache",
         lambda s: not (_is_embedding(s) and s.engine.kv_cache_memory is not None),
         cel="self.kind != 'embedding' || !has(self.engine.kvCacheMemory)"),
    Rule("", "engine.kvCacheDtype",
         "engine.kvCacheDtype is a generation setting; an embedding model keeps no KV cache",
         lambda s: not (_is_embedding(s) and s.engine.kv_cache_dtype != "auto"),
         cel="self.kind != 'embedding' || self.engine.kvCacheDtype == 'auto'"),
    Rule("", "engine.quantizeHead",
         "engine.quantizeHead is a generation setting; an embedding model has no output head",
         lambda s: not (_is_embedding(s) and s.engine.quantize_head is not None),
         cel="self.kind != 'embedding' || !has(self.engine.quantizeHead)"),
    Rule("", "engine.decodeSteps", "engine.decodeSteps is a generation setting; an embedding model does not decode",
         lambda s: not (_is_embedding(s) and s.engine.decode_steps is not None),
         cel="self.kind != 'embedding' || !has(self.engine.decodeSteps)"),
    Rule("", "engine.requantizeQ4", "engine.requantizeQ4 is a generation setting (cpu-int8's GGUF weights)",
         lambda s: not (_is_embedding(s) and s.engine.requantize_q4),
         cel="self.kind != 'embedding' || !self.engine.requantizeQ4"),
    Rule("", "engine.speculative", "engine.speculative is a generation setting; an embedding model does not decode",
         lambda s: not (_is_embedding(s) and s.engine.speculative is not None),
         cel="self.kind != 'embedding' || !has(self.engine.speculative)"),
    Rule("", "engine.maxLoras", "engine.maxLoras is a generation setting; an embedding model serves no LoRA adapters",
         lambda s: not (_is_embedding(s) and s.engine.max_loras > 0),
         cel="self.kind != 'embedding' || self.engine.maxLoras == 0"),
    Rule("", "adapters", "adapters: preloading them needs engine.maxLoras at least the number listed",
         lambda s: len(s.adapters) <= s.engine.max_loras,
         cel="!has(self.adapters) || size(self.adapters) <= self.engine.maxLoras"),
    Rule("", "workload", "workload hints choose among generative runtimes; an embedding deployment takes none",
         lambda s: not (_is_embedding(s) and (s.workload.multi_turn or s.workload.shared_prefix or s.workload.agent)),
         cel="self.kind != 'embedding' || !(self.workload.multiTurn || self.workload.sharedPrefix || "
             "self.workload.agent)"),
    # KV tiers keep blocks the radix manager lets go; paged keeps none, and an embedding model no KV.
    Rule("", "engine.kvOffloadMemory", "engine.kvOffloadMemory needs the radix KV manager: runtime radix, "
         "cpu-int8 or auto (an embedding model keeps no KV)",
         lambda s: s.engine.kv_offload_memory is None or (s.runtime != "paged" and not _is_embedding(s)),
         cel="!has(self.engine.kvOffloadMemory) || (self.runtime != 'paged' && self.kind != 'embedding')"),
    Rule("", "engine.kvOffloadDisk", "engine.kvOffloadDisk needs the radix KV manager: runtime radix, "
         "cpu-int8 or auto (an embedding model keeps no KV)",
         lambda s: s.engine.kv_offload_disk is None or (s.runtime != "paged" and not _is_embedding(s)),
         cel="!has(self.engine.kvOffloadDisk) || (self.runtime != 'paged' && self.kind != 'embedding')"),
    Rule("", "engine.kvEvents", "engine.kvEvents needs the radix KV manager: runtime radix, cpu-int8 or auto "
         "(an embedding model keeps no KV)",
         lambda s: not s.engine.kv_events or (s.runtime != "paged" and not _is_embedding(s)),
         cel="!has(self.engine.kvEvents) || !self.engine.kvEvents || (self.runtime != 'paged' && "
             "self.kind != 'embedding')"),
    Rule("", "routing.policy", "routing.policy kv-aware reads the workers' KV events: it needs the radix KV "
         "manager (runtime radix, cpu-int8 or auto) and engine.kvEvents not false",
         lambda s: s.routing.policy != "kv-aware" or (s.runtime != "paged" and not _is_embedding(s)
                                                       and s.engine.kv_events is not False),
         cel="!has(self.routing.policy) || self.routing.policy != 'kv-aware' || (self.runtime != 'paged' && "
             "self.kind != 'embedding' && (!has(self.engine.kvEvents) || self.engine.kvEvents))"),
    Rule("", "engine.enforceEager", "engine.enforceEager turns off CUDA graphs: it needs a GPU (resources.gpus > 0)",
         lambda s: not (s.engine.enforce_eager and s.resources.gpus == 0),
         cel="!(self.engine.enforceEager && self.resources.gpus == 0)"),
    Rule("", "engine.dtype", "float16 needs a GPU (resources.gpus > 0); use float32 or bfloat16",
         lambda s: not (s.resources.gpus == 0 and s.engine.dtype == "float16"),
         cel="!(self.resources.gpus == 0 && self.engine.dtype == 'float16')"),
    Rule("engine", "engine.maxNumBatchedTokens",
         "maxNumBatchedTokens must be at least maxNumSeqs: every running sequence needs one token per step",
         lambda s: (s.engine.max_num_batched_tokens is None or s.engine.max_num_seqs is None
                    or s.engine.max_num_batched_tokens >= s.engine.max_num_seqs),
         cel="!(has(self.maxNumBatchedTokens) && has(self.maxNumSeqs)) || self.maxNumBatchedTokens >= self.maxNumSeqs"),
    Rule("autoscaling", "autoscaling.panicWindowSeconds",
         "autoscaling.panicWindowSeconds must be shorter than autoscaling.stableWindowSeconds",
         lambda s: s.autoscaling.panic_window_seconds < s.autoscaling.stable_window_seconds,
         # has(): the API server also checks the section's default ({}) before defaulting its fields.
         cel="!has(self.panicWindowSeconds) || !has(self.stableWindowSeconds) || "
             "self.panicWindowSeconds < self.stableWindowSeconds"),
    *_resource_rules("resources", lambda s: s.resources),
    Rule("", "engine.kvCacheMemory",
         "is a fraction of free GPU memory, but resources.gpus is 0; give a byte size such as 2GiB",
         _kv_fraction_has_gpu),
    Rule("", "engine.kvCacheMemory",
         "does not fit in resources.memory, which on a CPU worker must also hold the weights",
         _kv_bytes_fit_memory),
    # Disaggregation: the prefill worker keeps a prompt's KV blocks in its memory tier for the decode
    # worker to pull, and tiers are the radix KV manager's (the engine.kvOffloadMemory rule above).
    Rule("", "disaggregation.enabled", "disaggregation.enabled needs the radix KV manager: runtime radix, "
         "cpu-int8 or auto, and kind generate (prompts' KV moves between the pools through its memory tier)",
         lambda s: not s.disaggregation.enabled or (s.runtime in ("radix", "cpu-int8", "auto")
                                                    and s.kind == "generate"),
         cel="!self.disaggregation.enabled || (self.runtime in ['radix', 'cpu-int8', 'auto'] && "
             "self.kind == 'generate')"),
    Rule("", "disaggregation.prefill.minReplicas",
         "disaggregation.prefill.minReplicas must not exceed disaggregation.prefill.maxReplicas",
         lambda s: _prefill(s).max_replicas is None or _prefill(s).min_replicas <= _prefill(s).max_replicas,
         cel="!has(self.disaggregation.prefill.maxReplicas) || "
             "self.disaggregation.prefill.minReplicas <= self.disaggregation.prefill.maxReplicas"),
    Rule("", "disaggregation.prefill.replicas",
         "disaggregation.prefill.replicas must lie within disaggregation.prefill.minReplicas..maxReplicas",
         lambda s: _prefill(s).min_replicas <= _prefill(s).replicas and (
             _prefill(s).max_replicas is None or _prefill(s).replicas <= _prefill(s).max_replicas),
         cel="self.disaggregation.prefill.replicas >= self.disaggregation.prefill.minReplicas && "
             "(!has(self.disaggregation.prefill.maxReplicas) || "
             "self.disaggregation.prefill.replicas <= self.disaggregation.prefill.maxReplicas)"),
    Rule("", "disaggregation.prefill.resources.gpus",
         "the prefill pool runs where the decode pool does: disaggregation.prefill.resources.gpus must be above 0 "
         "exactly when resources.gpus is (a decode worker uses the KV a prefill worker computed, in its layout)",
         lambda s: _prefill(s).resources is None or (_prefill(s).resources.gpus > 0) == s.uses_gpu,
         cel="!has(self.disaggregation.prefill.resources) || "
             "(self.disaggregation.prefill.resources.gpus > 0) == (self.resources.gpus > 0)"),
    # A prefill pool scaled to zero would stay there: its signals are its own workers' (the decode
    # pool computes every prompt meanwhile, so no request waits for it to come back).
    Rule("", "disaggregation.prefill.minReplicas",
         "disaggregation.prefill.minReplicas must be at least 1 with autoscaling enabled (a prefill pool at "
         "zero has no workers' load to scale back up by); to stop using the pool, set disaggregation.enabled false",
         lambda s: not (s.disaggregation.enabled and s.autoscaling.enabled and _prefill(s).min_replicas < 1),
         cel="!(self.disaggregation.enabled && self.autoscaling.enabled && "
             "self.disaggregation.prefill.minReplicas < 1)"),
    *_resource_rules("disaggregation.prefill.resources", lambda s: _prefill(s).resources),
)


def section_models() -> dict[str, type[Section]]:
    """The spec's sections by the name users write ("" is the spec itself)."""
    sections: dict[str, type[Section]] = {"": InferenceDeploymentSpec}
    for name, info in InferenceDeploymentSpec.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
            sections[info.alias or name] = info.annotation
    return sections


def field_names(model: type[Section]) -> tuple[str, ...]:
    return tuple(info.alias or name for name, info in model.model_fields.items())


# The fields of each section as users write them (derived from the models, for messages and tests).
FIELDS: dict[str, tuple[str, ...]] = {section: field_names(model) for section, model in section_models().items()}

_TYPE_NAMES = {"int": "integer", "float": "number", "bool": "bool", "str": "string", "dict": "an object",
               "list": "a list"}


def spec_error(exc: ValidationError) -> SpecError:
    """The first of pydantic's errors as a SpecError: the field as users write it and a plain reason."""
    error = exc.errors()[0]
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    path = ".".join(str(part) for part in error["loc"])
    got = "a boolean" if isinstance(value, bool) else type(value).__name__
    if kind == "spec_rule":
        return SpecError(ctx["field"], ctx["reason"])
    if kind == "extra_forbidden":
        section = path.rpartition(".")[0]
        known = FIELDS.get(section)
        return SpecError(path, f"unknown field; {section or 'spec'} has {', '.join(known)}" if known
                         else "unknown field")
    if kind == "missing":
        if path == "model":
            return SpecError(path, "is required: {name: <registry name>} or {uri: <path>, format: <format>}")
        return SpecError(path, "is required")
    if kind == "literal_error":
        return SpecError(path, f"must be one of {ctx['expected']}; got {value!r}")
    if kind in ("greater_than_equal", "greater_than"):
        return SpecError(path, f"must be at least {ctx.get('ge', ctx.get('gt'))}, got {value}")
    if kind in ("less_than_equal", "less_than"):
        return SpecError(path, f"must be at most {ctx.get('le', ctx.get('lt'))}, got {value}")
    if kind == "string_pattern_mismatch":
        return SpecError(path, f"{value!r} {PATTERN_HINTS.get(ctx['pattern'], 'must match ' + ctx['pattern'])}")
    if kind in ("string_too_long", "string_too_short"):
        bound = "at most" if kind == "string_too_long" else "at least"
        return SpecError(path, f"must be {bound} {ctx.get('max_length', ctx.get('min_length'))} characters")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return SpecError(path, f"expected an object, got {got}")
    if kind.endswith("_type"):
        expected = _TYPE_NAMES.get(kind.removesuffix("_type"), kind.removesuffix("_type"))
        return SpecError(path, f"expected {expected}, got {got}")
    return SpecError(path, error["msg"])
