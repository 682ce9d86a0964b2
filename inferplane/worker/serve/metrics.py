"""Prometheus metrics of one worker.

Request-level figures (finish reasons, TTFT, time per output token, latency, token counts) are
recorded as requests finish; engine gauges (running, waiting, KV blocks, preemptions, prefix
cache, int8 gate figures) are read from the engine's last stats snapshot at scrape time, so they
are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferplane.api import metric_names as m
from inferplane.worker.engine.outputs import StepOutput
from inferplane.worker.engine.stats import QUEUE_STAT_PREFIX

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)

# Engine stats exported as counters (monotonic); every other numeric stat is a gauge.
# What the SLO alerts count: a finished generation is "ok", a client cancel is not an error.
_OUTCOMES = {"stop": "ok", "length": "ok", "abort": "cancelled"}

_COUNTER_STATS = {
    "preemptions": m.WORKER_PREEMPTIONS,
    "prefix_query_tokens": m.WORKER_PREFIX_QUERY_TOKENS,
    "prefix_hit_tokens": m.WORKER_PREFIX_HIT_TOKENS,
    "evicted_blocks": m.WORKER_PREFIX_EVICTED_BLOCKS,
    "fair_share_preemptions": m.WORKER_FAIR_SHARE_PREEMPTIONS,
    "lora_loads_total": m.WORKER_LORA_LOADS,
    "lora_evictions_total": m.WORKER_LORA_EVICTIONS,
    "kv_tier_misses_total": m.WORKER_KV_TIER_MISSES,
    "kv_tier_rejected_total": m.WORKER_KV_TIER_REJECTED,
    "kv_tier_prefetched_total": m.WORKER_KV_TIER_PREFETCHED,
    "kv_tier_saved_blocks_total": m.WORKER_KV_TIER_SAVED,
    "kv_tier_loaded_blocks_total": m.WORKER_KV_TIER_LOADED,
    "kv_events_published_total": m.WORKER_KV_EVENTS,
    "kv_transfer_failures_total": m.WORKER_KV_TRANSFER_FAILURES,
    "spec_skipped_no_room_total": m.WORKER_SPEC_NO_ROOM,
}
_GAUGE_STATS = {
    "num_running": m.WORKER_RUNNING,
    "num_waiting": m.WORKER_WAITING,
    "blocks_used": m.WORKER_KV_USED,
    "blocks_total": m.WORKER_KV_CAPACITY,  # not _total: a gauge (promtool lint)
    "blocks_cached": m.WORKER_KV_CACHED,
    "peak_blocks_used": m.WORKER_KV_PEAK,
    "tree_nodes": m.WORKER_TREE_NODES,
    "native_kernels": m.WORKER_NATIVE_KERNELS,
    "lora_slots": m.WORKER_LORA_SLOTS,
    "lora_slots_loaded": m.WORKER_LORA_SLOTS_LOADED,
    "lora_waiting": m.WORKER_LORA_WAITING,
}
# Stats with one label ("<prefix><label value>"): (metric, help, counter?, label)
_LABELLED_STATS = {
    "lora_requests:": (m.WORKER_LORA_REQUESTS, "requests per LoRA adapter", True, "adapter"),
    "lora_loaded:": (m.WORKER_LORA_LOADED, "1 for each LoRA adapter in a slot now", False, "adapter"),
    "kv_transfer_blocks_total:": (m.WORKER_KV_TRANSFER_BLOCKS, "KV blocks moved between workers (disaggregation), "
                                  "by direction: pulled here or served to another", True, "direction"),
    "kv_transfer_bytes_total:": (m.WORKER_KV_TRANSFER_BYTES, "KV record bytes moved between workers, by direction",
                                 True, "direction"),
    "kv_transfer_seconds_total:": (m.WORKER_KV_TRANSFER_SECONDS, "time spent pulling KV from, or serving it to, "
                                   "another worker, by direction", True, "direction"),
    "spec_proposed_tokens_total:": (m.WORKER_SPEC_PROPOSED, "speculative decoding: draft tokens verified, by "
                                    "method", True, "method"),
    "spec_accepted_tokens_total:": (m.WORKER_SPEC_ACCEPTED, "speculative decoding: draft tokens kept, by method",
                                    True, "method"),
    "spec_verifications_total:": (m.WORKER_SPEC_VERIFICATIONS, "speculative decoding: decode rows that verified "
                                  "a draft, by method", True, "method"),
    "kv_tier_blocks:": (m.WORKER_KV_TIER_BLOCKS, "KV blocks each tier holds", False, "tier"),
    "kv_tier_bytes:": (m.WORKER_KV_TIER_BYTES, "bytes each KV tier holds", False, "tier"),
    "kv_tier_hits_total:": (m.WORKER_KV_TIER_HITS, "KV blocks read from each tier", True, "tier"),
    "kv_tier_stored_total:": (m.WORKER_KV_TIER_STORED, "KV blocks written to each tier", True, "tier"),
    "kv_tier_evicted_total:": (m.WORKER_KV_TIER_EVICTED, "KV blocks each tier dropped for room", True, "tier"),
    "kv_tier_read_seconds_total:": (m.WORKER_KV_TIER_READ_SECONDS, "time spent reading blocks from each tier "
                                    "(checks and copies included)", True, "tier"),
}


class _EngineStatsCollector:
    def __init__(self, read_stats: Callable[[], dict[str, float]], labels: dict[str, str]):
        self._read = read_stats
        self._labels = labels

    def collect(self):
        stats = self._read()
        names, values = list(self._labels), list(self._labels.values())
        for key, metric in _COUNTER_STATS.items():
            if key in stats:
                family = CounterMetricFamily(metric, f"engine stat {key}", labels=names)
                family.add_metric(values, float(stats[key]))
                yield family
        for key, metric in _GAUGE_STATS.items():
            if key in stats:
                family = GaugeMetricFamily(metric, f"engine stat {key}", labels=names)
                family.add_metric(values, float(stats[key]))
                yield family
        kernels = [key.split(":")[1:] for key in stats if key.startswith("native_kernel:")]
        if kernels:
            family = GaugeMetricFamily(m.WORKER_NATIVE_KERNEL, "which ISA each C kernel runs on (torch: PyTorch's op)",
                                       labels=[*names, "kernel", "isa"])
            for kernel, isa in kernels:
                family.add_metric([*values, kernel, isa], 1.0)
            yield family
        for prefix, (metric, text, counter, label) in _LABELLED_STATS.items():
            found = [(key[len(prefix):], value) for key, value in stats.items() if key.startswith(prefix)]
            if found:
                family = (CounterMetricFamily if counter else GaugeMetricFamily)(metric, text,
                                                                                labels=[*names, label])
                for label_value, value in found:
                    family.add_metric([*values, label_value], float(value))
                yield family
        queues = [(key.split(":", 3)[1:], value) for key, value in stats.items() if key.startswith(QUEUE_STAT_PREFIX)]
        if queues:
            family = GaugeMetricFamily(m.WORKER_TENANT_SEQUENCES, "sequences per tenant and priority band, "
                                       "running or waiting (flow control)", labels=[*names, "state", "band", "tenant"])
            for (state, band, tenant), value in queues:
                family.add_metric([*values, state, band, tenant], float(value))
            yield family
        gate = {k: v for k, v in stats.items() if k.startswith(("gate_", "weight_bytes"))}
        if gate:
            family = GaugeMetricFamily(m.WORKER_WEIGHTS_INFO, "weight format and int8 quality gate figures",
                                       labels=[*names, "figure"])
            for key, value in gate.items():
                family.add_metric([*values, key], float(value))
            yield family


class WorkerMetrics:
    def __init__(self, model: str, runtime: str, read_stats: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry()
        labels = {"model": model, "runtime": runtime}
        names = list(labels)
        self._labels = labels
        # process_start_time_seconds moves when the process restarts: the restart alert counts that.
        ProcessCollector(registry=self.registry)
        self.requests = Counter(m.WORKER_REQUESTS, "finished requests by outcome and finish reason",
                                [*names, "outcome", "finish_reason"], registry=self.registry)
        self.ttft = Histogram(m.WORKER_TTFT, "time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(m.WORKER_TPOT, "decode time per output token",
                              names, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(m.WORKER_E2E, "request latency, arrival to finish",
                             names, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(m.WORKER_PROMPT_TOKENS, "prompt tokens of finished requests", names,
                                     registry=self.registry)
        self.generation_tokens = Counter(m.WORKER_GENERATION_TOKENS, "generated tokens of finished requests",
                                         names, registry=self.registry)
        self.registry.register(_EngineStatsCollector(read_stats, labels))

    def observe_embedding(self, prompt_tokens: int, seconds: float) -> None:
        """One answered embedding request: counted with the generations' (finish reason "stop"), so
        the request-rate and error-ratio alerts and dashboards cover embedding workers unchanged."""
        labels = self._labels
        self.requests.labels(**labels, outcome="ok", finish_reason="stop").inc()
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.e2e.labels(**labels).observe(seconds)

    def observe_finished(self, out: StepOutput) -> None:
        labels = self._labels
        reason = out.finish_reason or "unknown"
        self.generation_tokens.labels(**labels).inc(out.num_output_tokens)
        if out.index:  # choice 0 counts the request and its prompt once (n > 1)
            return
        self.requests.labels(**labels, outcome=_OUTCOMES.get(reason, "error"), finish_reason=reason).inc()
        self.prompt_tokens.labels(**labels).inc(out.num_prompt_tokens)
        if out.latency is not None:
            self.e2e.labels(**labels).observe(out.latency)
        if out.ttft is not None:
            self.ttft.labels(**labels).observe(out.ttft)
            if out.num_output_tokens > 1 and out.latency is not None:
                self.tpot.labels(**labels).observe((out.latency - out.ttft) / (out.num_output_tokens - 1))
