"""From a spec to what runs: the runtime presets and `resolve(spec) -> ResolvedDeployment`.

The three generative runtimes are presets of one engine (see ARCHITECTURE.md): a KV manager, a
weight format, where it may run and the engine defaults below; the fourth, `embedding`, runs an
encoder model's batched forward and keeps no KV cache (worker/embedding/). `PRESETS` is the one
registry of them: the worker builds its KV manager and weights from an entry, and `resolve` fills
what a spec leaves open from one. `resolve` is the only place that turns `runtime: auto` into a
runtime (and says why, for the status), picks device and dtype and merges presets with the spec's
`engine` section; the operator (pod specs), the gateway's cluster sync, local mode and the worker's
command line all take its answer, so they cannot disagree. The merge itself is `engine_settings`,
which the worker applies to its own options too: `LLM(runtime=...)`, `inferplane worker --runtime`
and a deployment of one runtime run with the same settings. A disaggregated deployment's prefill
pool runs what `resolve(prefill_spec(spec))` says: the same engine on the prefill pool's resources.
It also holds the one rule for cache isolation, and the one for the default priority band, across
the deployments behind a served name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from inferplane.api.deployment import ConcreteRuntime, InferenceDeploymentSpec
from inferplane.api.priority import band_rank
from inferplane.api.quantities import parse_quantity

# The KV memory tier of a disaggregated deployment's workers where engine.kvOffloadMemory is unset
# (kv_offload_memory): room for the prompts a prefill worker holds until their decode workers pull them.
DISAGGREGATION_TIER_MEMORY = "512MiB"


@dataclass(frozen=True)
class RuntimePreset:
    """One runtime: what the engine is built from, and the engine defaults a spec may override."""

    name: str
    kv_manager: Literal["paged", "radix"] | None  # None: no KV cache (embedding)
    weights: Literal["dense", "int8"]
    cpu_only: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_gpu: str | None
    kv_cache_memory_cpu: str | None
    # What a KV cache left at `auto` stores: "auto" is the compute dtype. cpu-int8 computes in
    # float32 and keeps float16 keys and values, as llama.cpp does by default: twice the tokens in
    # the same memory and half the bytes each decode step's attention reads (SmolLM2's perplexity
    # moved -0.1% and +0.25% in two runs, tests/worker/test_kv_cache_dtype.py).
    kv_cache_dtype: str = "auto"
    # Greedy decode steps per call where the engine can run a burst (worker engine/decode_bursts.py):
    # only cpu-int8's fused C decode does; 8 keeps a new request's wait under 8 steps.
    decode_steps: int = 1


PRESETS: dict[str, RuntimePreset] = {preset.name: preset for preset in (
    # Many short, independent requests: wide batches, most of the free GPU memory for KV blocks.
    RuntimePreset("paged", kv_manager="paged", weights="dense", cpu_only=False, max_num_seqs=256,
                  max_num_batched_tokens=8192, kv_cache_memory_gpu="0.9", kv_cache_memory_cpu="1GiB"),
    # Prefix reuse keeps more blocks alive; fewer concurrent sequences leave room for cached prefixes.
    RuntimePreset("radix", kv_manager="radix", weights="dense", cpu_only=False, max_num_seqs=128,
                  max_num_batched_tokens=8192, kv_cache_memory_gpu="0.9", kv_cache_memory_cpu="1GiB"),
    # CPU matmuls: small batches keep latency tolerable; the prefix tree saves recomputing prompts.
    RuntimePreset("cpu-int8", kv_manager="radix", weights="int8", cpu_only=True, max_num_seqs=16,
                  max_num_batched_tokens=2048, kv_cache_memory_gpu="1GiB", kv_cache_memory_cpu="1GiB",
                  kv_cache_dtype="float16", decode_steps=8),
    # An encoder's forward over padded inputs: maxNumSeqs inputs and maxNumBatchedTokens padded tokens
    # per forward at most (one input always goes, however long), nothing kept between forwards.
    RuntimePreset("embedding", kv_manager=None, weights="dense", cpu_only=False, max_num_seqs=64,
                  max_num_batched_tokens=8192, kv_cache_memory_gpu=None, kv_cache_memory_cpu=None),
)}
assert tuple(PRESETS) == ConcreteRuntime.__args__, "every runtime the spec names has exactly one preset"


@dataclass(frozen=True)
class ResolvedDeployment:
    """Everything a worker of a spec is started with, after `auto` and the presets are decided.

    `engine` holds every field of the spec's `engine` section by its Python name, which is also
    the worker's option and flag (`--max-num-seqs` for max_num_seqs), with the preset's value where
    the spec left one open; a new engine field thus reaches the worker with no code here.
    """

    runtime: str
    reason: str  # why this runtime, for status.runtimeReason
    device: Literal["cpu", "cuda"]
    engine: Mapping[str, str | int | bool | None]
    cpu_threads: int | None  # CPU workers: the pod's CPU allowance, not the node's cores
    routing_policy: str = "prefix-hash"  # how the gateway picks a replica (`routing_policy`)

    @property
    def preset(self) -> RuntimePreset:
        return PRESETS[self.runtime]

    @property
    def dtype(self) -> str:
        return str(self.engine["dtype"])

    @property
    def block_size(self) -> int:
        return int(self.engine["block_size"])  # type: ignore[arg-type]

    def engine_args(self) -> list[str]:
        """The `inferplane worker` flags for this resolution (the engine part of its command line)."""
        args = ["--runtime", self.runtime, "--device", self.device]
        for name, value in self.engine.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is False:
                args.append("--no-" + flag[2:])
            elif value is not None:
                args += [flag, str(value)]
        return args


def _choose_runtime(spec: InferenceDeploymentSpec) -> tuple[str, str]:
    """`auto`: an embedding model → embedding; no GPU → cpu-int8; prefix-sharing traffic → radix;
    otherwise paged. The model's kind is the spec's `kind`, not read from the weights: resolve() is
    pure (the operator, the gateway's sync and local mode call it without the files), and the worker
    refuses weights of the other kind at start-up (worker/serve/cli.py)."""
    hints = spec.workload
    if spec.runtime != "auto":
        return spec.runtime, f"runtime {spec.runtime} was requested in the spec"
    if spec.kind == "embedding":
        return "embedding", "auto: kind embedding, so the embedding runtime (batched encoder forward, no KV cache)"
    if not spec.uses_gpu:
        return "cpu-int8", "auto: no GPU requested (resources.gpus is 0), so int8 weights on CPU"
    named = [n for n, on in (("multiTurn", hints.multi_turn), ("sharedPrefix", hints.shared_prefix),
                             ("agent", hints.agent)) if on]
    if named:
        return "radix", f"auto: workload hints {', '.join(named)} reuse prefixes, so the radix cache"
    if spec.disaggregation.enabled:
        return "radix", ("auto: disaggregation moves prompts' KV from the prefill pool to the decode pool "
                         "through the radix cache's memory tier")
    if spec.engine.kv_offload_memory is not None or spec.engine.kv_offload_disk is not None:
        return "radix", "auto: KV tiers (engine.kvOffload*) keep the blocks the radix cache lets go"
    if spec.engine.kv_events or spec.routing.policy == "kv-aware":
        return "radix", "auto: KV events (engine.kvEvents, kv-aware routing) come from the radix cache"
    return "paged", "auto: GPU without prefix-sharing hints, so paged KV for high concurrency"


def default_dtype(device: str) -> str:
    """The compute dtype where none is asked for: bfloat16 on a GPU, float32 on a CPU."""
    return "bfloat16" if device == "cuda" else "float32"


def engine_settings(runtime: str, device: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` engine settings with what they leave open (None; `auto` for the dtypes) filled from
    `runtime`'s preset on `device` ("cpu" or "cuda"): the one rule for the engine's defaults."""
    preset = PRESETS[runtime]
    engine = dict(given)
    if engine.get("dtype") in (None, "auto"):
        engine["dtype"] = default_dtype(device)
    max_seqs = engine["max_num_seqs"] = given.get("max_num_seqs") or preset.max_num_seqs
    # A preset's token budget never undercuts an explicit maxNumSeqs (one token per sequence per step).
    engine["max_num_batched_tokens"] = given.get("max_num_batched_tokens") or max(preset.max_num_batched_tokens,
                                                                                  max_seqs)
    engine["kv_cache_memory"] = given.get("kv_cache_memory") or (
        preset.kv_cache_memory_gpu if device == "cuda" else preset.kv_cache_memory_cpu)  # None: no KV cache
    if engine.get("kv_cache_dtype") in (None, "auto"):
        engine["kv_cache_dtype"] = preset.kv_cache_dtype
    engine["decode_steps"] = given.get("decode_steps") or preset.decode_steps
    return engine


def resolve(spec: InferenceDeploymentSpec) -> ResolvedDeployment:
    runtime, reason = _choose_runtime(spec)
    preset = PRESETS[runtime]
    device: Literal["cpu", "cuda"] = "cuda" if spec.uses_gpu and not preset.cpu_only else "cpu"
    engine: dict[str, str | int | bool | None] = engine_settings(runtime, device, spec.engine.model_dump())
    speculative = spec.engine.speculative  # a section: the worker's flag takes it as JSON, as vLLM's
    engine["speculative"] = speculative.model_dump_json(by_alias=True) if speculative is not None else None
    engine["kv_offload_memory"] = kv_offload_memory(spec)
    # An int8 option; `auto` may have picked a GPU runtime, which has no int8 head.
    engine["quantize_head"] = spec.engine.quantize_head if preset.weights == "int8" else None
    engine["requantize_q4"] = spec.engine.requantize_q4 and preset.weights == "int8"
    engine["decode_steps"] = engine["decode_steps"] if preset.weights == "int8" else preset.decode_steps
    return ResolvedDeployment(
        runtime=runtime, reason=reason, device=device, engine=engine,
        cpu_threads=max(1, math.floor(parse_quantity(spec.resources.cpu))) if device == "cpu" else None,
        routing_policy=routing_policy(spec, runtime),
    )


def kv_offload_memory(spec: InferenceDeploymentSpec) -> str | None:
    """The KV memory tier a worker keeps: engine.kvOffloadMemory, or where a disaggregated spec
    leaves it out DISAGGREGATION_TIER_MEMORY, since KV moves between the pools through it (a prefill
    worker keeps a prompt's blocks there until the decode worker pulls them, and the decode worker
    receives them there). Counted in resources.memory like a tier asked for (api/footprint.py)."""
    if spec.engine.kv_offload_memory is None and spec.disaggregation.enabled:
        return DISAGGREGATION_TIER_MEMORY
    return spec.engine.kv_offload_memory


def prefill_spec(spec: InferenceDeploymentSpec) -> InferenceDeploymentSpec:
    """What the prefill pool's workers are built from: the spec with disaggregation.prefill's
    replicas and resources (spec.resources where it sets none). The model, runtime and engine stay
    the decode pool's, since a decode worker uses the KV a prefill worker computed; so
    resolve(prefill_spec(spec)) differs from resolve(spec) only in cpu_threads (the prefill pods'
    CPU; the rules keep both pools on one device). The spec's rules were checked on `spec`: the copy
    is not validated again (its replica bounds are the prefill pool's)."""
    pool = spec.disaggregation.prefill
    return spec.model_copy(update={"replicas": pool.replicas, "min_replicas": pool.min_replicas,
                                   "max_replicas": pool.max_replicas, "resources": pool.resources or spec.resources})


def routing_policy(spec: InferenceDeploymentSpec, runtime: str) -> str:
    """The spec's routing.policy, or where it is unset: kv-aware when the replicas keep KV tiers
    (asked for, or a disaggregated deployment's) and publish KV events (the radix KV manager, events
    not turned off), else prefix-hash, which needs no events and keeps a conversation's turns
    together on a hash ring."""
    if spec.routing.policy is not None:
        return spec.routing.policy
    tiers = kv_offload_memory(spec) is not None or spec.engine.kv_offload_disk is not None
    events = PRESETS[runtime].kv_manager == "radix" and spec.engine.kv_events is not False
    return "kv-aware" if tiers and events else "prefix-hash"


def served_cache_isolation(isolations: Iterable[str]) -> str:
    """The cache isolation of a served model name from its deployments' `cacheIsolation`s.

    "shared" only if every deployment behind the name asks for it: one "tenant" deployment means
    tenants' prompts must not share prefix caches there, so the stricter wins. The gateway applies
    it (one salt for all, or one per tenant) and the workers obey the salt, in cluster and local
    mode alike.
    """
    isolations = list(isolations)
    return "shared" if isolations and all(i == "shared" for i in isolations) else "tenant"


def served_priority(bands: Iterable[str | None]) -> str | None:
    """The default band of a served model name from its deployments' `priority`s (None: none set).

    The gateway picks the band before it routes, so one name has one default: when deployments
    disagree, the most urgent any of them asks for wins (an owner who set critical is not lowered
    by a sibling deployment); the key's and tenant's bands still come first (priority.resolve_band).
    """
    chosen = [band for band in bands if band]
    return min(chosen, key=band_rank) if chosen else None
