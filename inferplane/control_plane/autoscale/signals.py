"""Saturation: one number per deployment from what its workers and the gateway report.

Per replica, two pressures, each against its target from the spec's `autoscaling` section:
  concurrency = (running + waiting) / (maxNumSeqs + targetQueueDepth): 1.0 when every slot is busy
                and targetQueueDepth requests wait (waiting also counts what this gateway has in
                flight beyond the slots, for a worker that stopped reporting)
  kv          = KV blocks in use / total / targetKvCacheUtilization; blocks the radix cache holds
                only for reuse count as free (they are reclaimed on demand; the worker reports them
                apart, as blocks_cached, and leaves them out of blocks_used)
and a replica's load is the larger of the two. Concurrency dominates with many short requests: the
slots fill, KV stays low, and only the queue shows the backlog. KV dominates with long contexts: few
sequences run, the queue is empty, and the pool nears full, where preemption would thrash. Scaling
on either alone misses the other case (on the queue alone, busy replicas with an empty queue would
even look idle). TTFT against `slo.ttftP95Seconds` counts only while requests wait (then it
measures queueing, not long prompts).

The deployment's saturation is the sum over replicas, plus requests the gateway holds for it at zero
replicas; it reads as "replicas' worth of load", so the desired count is its ceiling (see decision).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferplane.api.deployment import Autoscaling

_SPEC = Autoscaling()  # the spec's targets are the defaults here


@dataclass(frozen=True)
class ReplicaSignals:
    running: int = 0
    waiting: int = 0
    max_num_seqs: int = 1
    blocks_used: int = 0  # held by running sequences (radix: cache-only blocks excluded)
    blocks_cached: int = 0  # held by the prefix cache alone: reclaimable, so not load
    blocks_total: int = 0
    gateway_in_flight: int = 0  # this gateway's requests on the replica (covers a worker that stopped reporting)
    ttft_p95_seconds: float | None = None


@dataclass(frozen=True)
class Targets:
    queue_depth: float = _SPEC.target_queue_depth
    kv_cache_utilization: float = _SPEC.target_kv_cache_utilization
    ttft_p95_seconds: float | None = None


def replica_load(s: ReplicaSignals, targets: Targets) -> float:
    """One replica's load in replicas' worth (1.0 = exactly at target)."""
    slots = max(s.max_num_seqs, 1)
    waiting = max(s.waiting, s.gateway_in_flight - slots, 0)
    running = max(s.running, min(s.gateway_in_flight, slots))
    concurrency = (running + waiting) / (slots + targets.queue_depth)
    kv = 0.0
    if s.blocks_total > 0:
        kv = s.blocks_used / s.blocks_total / targets.kv_cache_utilization
    ttft = 0.0
    if waiting > 0 and targets.ttft_p95_seconds and s.ttft_p95_seconds is not None:
        ttft = s.ttft_p95_seconds / targets.ttft_p95_seconds
    return max(concurrency, kv, ttft)


def saturation(replicas: Iterable[ReplicaSignals], targets: Targets, *, held: int = 0) -> float:
    """The deployment's load in replicas' worth: the sum of its replicas', plus held requests (at zero
    replicas: any held request asks for a replica)."""
    total = sum(replica_load(r, targets) for r in replicas)
    return total + (max(1.0, held / targets.queue_depth) if held else 0.0)
