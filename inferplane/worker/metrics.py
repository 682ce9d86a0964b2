"""Prometheus metrics of one worker.

Request-level figures (finish reasons, TTFT, time per output token, latency, token counts) are
recorded as requests finish; engine gauges (running, waiting, KV blocks, preemptions, prefix
cache, int8 gate figures) are read from the engine's last stats snapshot at scrape time, so they
are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inferplane.worker.engine import StepOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)

# Engine stats exported as counters (monotonic); every other numeric stat is a gauge.
# What the SLO alerts count: a finished generation is "ok", a client cancel is not an error.
_OUTCOMES = {"stop": "ok", "length": "ok", "abort": "cancelled"}

_COUNTER_STATS = {
    "preemptions": "inferplane_worker_preemptions_total",
    "prefix_query_tokens": "inferplane_worker_prefix_cache_query_tokens_total",
    "prefix_hit_tokens": "inferplane_worker_prefix_cache_hit_tokens_total",
    "evicted_blocks": "inferplane_worker_prefix_cache_evicted_blocks_total",
}
_GAUGE_STATS = {
    "num_running": "inferplane_worker_num_requests_running",
    "num_waiting": "inferplane_worker_num_requests_waiting",
    "blocks_used": "inferplane_worker_kv_blocks_used",
    "blocks_total": "inferplane_worker_kv_blocks_capacity",  # not _total: a gauge (promtool lint)
    "blocks_cached": "inferplane_worker_kv_blocks_cached",
    "peak_blocks_used": "inferplane_worker_kv_blocks_peak_used",
    "tree_nodes": "inferplane_worker_prefix_cache_tree_nodes",
    "native_kernels": "inferplane_worker_native_kernels",
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
                family = CounterMetricFamily(metric.removesuffix("_total"), f"engine stat {key}", labels=names)
                family.add_metric(values, float(stats[key]))
                yield family
        for key, metric in _GAUGE_STATS.items():
            if key in stats:
                family = GaugeMetricFamily(metric, f"engine stat {key}", labels=names)
                family.add_metric(values, float(stats[key]))
                yield family
        gate = {k: v for k, v in stats.items() if k.startswith(("gate_", "weight_bytes"))}
        if gate:
            family = GaugeMetricFamily("inferplane_worker_weights_info", "weight format and int8 quality gate figures",
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
        self.requests = Counter("inferplane_worker_requests", "finished requests by outcome and finish reason",
                                [*names, "outcome", "finish_reason"], registry=self.registry)
        self.ttft = Histogram("inferplane_worker_time_to_first_token_seconds", "time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("inferplane_worker_time_per_output_token_seconds", "decode time per output token",
                              names, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("inferplane_worker_e2e_request_latency_seconds", "request latency, arrival to finish",
                             names, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("inferplane_worker_prompt_tokens", "prompt tokens of finished requests", names,
                                     registry=self.registry)
        self.generation_tokens = Counter("inferplane_worker_generation_tokens", "generated tokens of finished requests",
                                         names, registry=self.registry)
        self.registry.register(_EngineStatsCollector(read_stats, labels))

    def observe_finished(self, out: StepOutput) -> None:
        labels = self._labels
        reason = out.finish_reason or "unknown"
        self.requests.labels(**labels, outcome=_OUTCOMES.get(reason, "error"), finish_reason=reason).inc()
        self.prompt_tokens.labels(**labels).inc(out.num_prompt_tokens)
        self.generation_tokens.labels(**labels).inc(out.num_output_tokens)
        if out.latency is not None:
            self.e2e.labels(**labels).observe(out.latency)
        if out.ttft is not None:
            self.ttft.labels(**labels).observe(out.ttft)
            if out.num_output_tokens > 1 and out.latency is not None:
                self.tpot.labels(**labels).observe((out.latency - out.ttft) / (out.num_output_tokens - 1))
