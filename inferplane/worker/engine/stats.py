"""What the engine counts, and the flat figures it reports (`Engine.stats()`): the KV pools,
the queues per tenant and band, forks, bursts, graphs, adapters and the C kernels in use.

serve/metrics.py turns these into Prometheus series (QUEUE_STAT_PREFIX keys carry their labels in
the key); LLM.stats() and the benchmarks read them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from inferplane.api.priority import BANDS

if TYPE_CHECKING:
    from inferplane.worker.engine.engine import Engine

QUEUE_STAT_PREFIX = "queue:"  # stats key queue:<running|waiting>:<band>:<tenant> -> sequences


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    forked_sequences: int = 0  # n > 1 choices that got the prompt's KV by fork
    forked_shared_blocks: int = 0  # prompt blocks those forks shared instead of computing
    fork_fallbacks: int = 0  # choices that found no slot or block at fork time and were queued instead
    burst_steps: int = 0  # decode steps run inside bursts after their first (decode_bursts.py)


def engine_stats(engine: Engine) -> dict[str, float]:
    scheduler, counters = engine.scheduler, engine.counters
    stats: dict[str, float] = dict(engine.kv.stats())
    stats.update(
        preemptions=scheduler.num_preemptions,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        prompt_tokens_total=counters.prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.options.max_num_seqs,  # the slots an autoscaler measures concurrency against
        forked_sequences=counters.forked_sequences,
        forked_shared_blocks=counters.forked_shared_blocks,
        fork_fallbacks=counters.fork_fallbacks,
        decode_burst_steps_total=counters.burst_steps,
        kv_cache_bytes=engine.cache.nbytes(),
        cuda_graph_steps=engine.runner.graphs.replays if engine.runner.graphs is not None else 0,
        cuda_graph_reserve_bytes=engine.pools.graph_reserve,  # taken from the KV budget for the graphs' pool
        fair_share_preemptions=scheduler.fair.preemptions,
    )
    # Per tenant and band: what flow control is doing (worker/serve/metrics.py labels these).
    for (state, tenant, band), count in scheduler.tenant_queues().items():
        stats[f"{QUEUE_STAT_PREFIX}{state}:{BANDS[band]}:{tenant}"] = float(count)
    if engine.speculator is not None:
        stats.update(engine.speculator.stats())
    adapters = engine.adapters
    if adapters is not None:
        stats.update(adapters.stats())
        # waiting for a slot: counted in num_waiting too, so the autoscaler's saturation sees them
        stats["lora_waiting"] = float(sum(1 for s in scheduler.waiting if s.adapter is not None
                                          and adapters.slot_of(s.adapter.key) is None))
    if engine.device.type == "cpu":  # which jobs run on the C kernels (and which ISA), which on PyTorch ops
        stats["native_kernels"] = float(sum(isa != "torch" for isa in engine.kernel_isas.values()))
        stats.update({f"native_kernel:{name}:{isa}": 1.0 for name, isa in engine.kernel_isas.items()})
    return stats
