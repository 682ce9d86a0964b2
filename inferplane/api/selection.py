"""Runtime presets and the `runtime: auto` choice.

The three runtimes are presets of one engine (see ARCHITECTURE.md); what differs between them is
the device, the weight format, the KV manager and the engine defaults below. `select_runtime` is
the only place that turns `auto` into a concrete runtime, and it says why, so that status can
tell the user. It lives in api/ because the operator (worker pods), the gateway's cluster sync and
local mode all need the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferplane.api.deployment import InferenceDeploymentSpec


@dataclass(frozen=True)
class Preset:
    """Engine defaults for a runtime; a field set in spec.engine overrides its preset."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_gpu: str
    kv_cache_memory_cpu: str


PRESETS: dict[str, Preset] = {
    # Many short, independent requests: wide batches, most of the free GPU memory for KV blocks.
    "paged": Preset(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory_gpu="0.9",
                    kv_cache_memory_cpu="1GiB"),
    # Prefix reuse keeps more blocks alive; fewer concurrent sequences leave room for cached prefixes.
    "radix": Preset(max_num_seqs=128, max_num_batched_tokens=8192, kv_cache_memory_gpu="0.9",
                    kv_cache_memory_cpu="1GiB"),
    # CPU matmuls: small batches keep latency tolerable.
    "cpu-int8": Preset(max_num_seqs=16, max_num_batched_tokens=2048, kv_cache_memory_gpu="1GiB",
                       kv_cache_memory_cpu="1GiB"),
}


@dataclass(frozen=True)
class Selection:
    """The concrete runtime for a spec, the device and dtype it runs with, and why it was chosen."""

    runtime: str
    reason: str
    device: str
    dtype: str


def select_runtime(spec: InferenceDeploymentSpec) -> Selection:
    """Resolve `auto`: no GPU → cpu-int8; prefix-sharing traffic → radix; otherwise paged."""
    hints = spec.workload
    if spec.runtime != "auto":
        runtime, reason = spec.runtime, f"runtime {spec.runtime} was requested in the spec"
    elif not spec.uses_gpu:
        runtime, reason = "cpu-int8", "auto: no GPU requested (resources.gpus is 0), so int8 weights on CPU"
    elif hints.multi_turn or hints.shared_prefix or hints.agent:
        named = [n for n, on in (("multiTurn", hints.multi_turn), ("sharedPrefix", hints.shared_prefix),
                                 ("agent", hints.agent)) if on]
        runtime, reason = "radix", f"auto: workload hints {', '.join(named)} reuse prefixes, so the radix cache"
    else:
        runtime, reason = "paged", "auto: GPU without prefix-sharing hints, so paged KV for high concurrency"
    device = "cuda" if spec.uses_gpu else "cpu"
    dtype = spec.engine.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return Selection(runtime=runtime, reason=reason, device=device, dtype=dtype)


@dataclass(frozen=True)
class EngineSettings:
    """Every engine flag the worker is started with, after presets fill what the spec left open."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: str
    dtype: str
    max_model_len: int | None


def engine_settings(spec: InferenceDeploymentSpec, selection: Selection) -> EngineSettings:
    preset = PRESETS[selection.runtime]
    engine = spec.engine
    kv_default = preset.kv_cache_memory_gpu if selection.device == "cuda" else preset.kv_cache_memory_cpu
    max_seqs = engine.max_num_seqs or preset.max_num_seqs
    return EngineSettings(
        block_size=engine.block_size,
        max_num_seqs=max_seqs,
        # A preset's token budget never undercuts an explicit maxNumSeqs (one token per sequence per step).
        max_num_batched_tokens=engine.max_num_batched_tokens or max(preset.max_num_batched_tokens, max_seqs),
        kv_cache_memory=engine.kv_cache_memory or kv_default,
        dtype=selection.dtype,
        max_model_len=engine.max_model_len,
    )


def served_cache_isolation(isolations: Iterable[str]) -> str:
    """The cache isolation of a served model name from its deployments' `cacheIsolation`s.

    "shared" only if every deployment behind the name asks for it: one "tenant" deployment means
    tenants' prompts must not share prefix caches there, so the stricter wins. The gateway applies
    it (one salt for all, or one per tenant) and the workers obey the salt, in cluster and local
    mode alike.
    """
    isolations = list(isolations)
    return "shared" if isolations and all(i == "shared" for i in isolations) else "tenant"
