"""Every metric we expose passes `promtool check metrics` (Prometheus' own naming and type lint).

Issue 20: `inferplane_worker_kv_blocks_total` was a gauge with a counter's `_total` suffix. The
gateway's registry (requests, tokens, limiter store errors, autoscaler gauges) and a worker's (with
every engine stat the exporter knows, int8 gate figures included) are rendered and linted.
"""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import generate_latest

from tests.services import installed


def promtool_lint(exposition: bytes) -> str:
    promtool = installed("promtool", package="prometheus")
    result = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    return (result.stdout + result.stderr).decode().strip() if result.returncode else ""


def test_the_gateways_metrics_pass_promtool() -> None:
    from inferplane.control_plane.autoscale.autoscaler import AutoscalerMetrics
    from inferplane.control_plane.gateway.metrics import (
        GatewayMetrics,
        PlatformCollector,
        PlatformSources,
        ReplicaCount,
    )

    metrics = GatewayMetrics()
    scaling = AutoscalerMetrics(metrics.registry)
    metrics.requests.labels("/v1/completions", "200").inc()
    metrics.latency.labels("/v1/completions").observe(0.1)
    metrics.ttft.labels("m").observe(0.01)
    metrics.tokens.labels("m", "prompt").inc(3)
    metrics.limiter_store_errors.labels("open").inc()
    metrics.key_admission("acme", "key-1", "rate_limited")
    metrics.billed("acme", "m", prompt_tokens=3, completion_tokens=5)
    metrics.registry.register(PlatformCollector(PlatformSources(
        database_up=lambda: True, usage_last_flush=lambda: None, usage_pending=lambda: 2,
        quotas=lambda: {"acme": (1000, 800)}, replicas=lambda: [ReplicaCount("m", "ns/chat", 1, 2)],
        routing_decisions=lambda: {("kv-aware", "held"): 7}, kv_index_blocks=lambda: 42,
        kv_replica_blocks=lambda: {"10.0.0.1:50051": {"pool": 30, "disk": 12}}, kv_event_batches=lambda: 9)))
    for gauge in (scaling.desired, scaling.current, scaling.maximum, scaling.saturation, scaling.panic):
        gauge.labels("ns/chat").set(1)
    exposition = generate_latest(metrics.registry)
    assert promtool_lint(exposition) == ""
    assert b'inferplane_key_requests_total{key="key-1",result="admitted",tenant="acme"} 0.0' in exposition
    assert b'inferplane_tenant_quota_used_tokens{tenant="acme"} 800.0' in exposition
    assert b'inferplane_gateway_routing_decisions_total{outcome="held",policy="kv-aware"} 7.0' in exposition
    assert b'inferplane_gateway_kv_index_replica_blocks{medium="disk",replica="10.0.0.1:50051"} 12.0' in exposition


def test_the_operators_metrics_pass_promtool() -> None:
    from inferplane.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    try:
        with metrics.reconcile():
            raise RuntimeError("apply failed")
    except RuntimeError:
        pass
    exposition = generate_latest(metrics.registry)
    assert promtool_lint(exposition) == ""
    assert b'inferplane_operator_reconciles_total{result="error"} 1.0' in exposition
    assert b'inferplane_operator_reconciles_total{result="ok"} 0.0' in exposition


@pytest.mark.parametrize("runtime", ["paged", "radix", "cpu-int8"])
def test_a_workers_metrics_pass_promtool(runtime: str) -> None:
    from inferplane.worker.serve import metrics as worker_metrics

    stats = {key: 1.0 for key in (*worker_metrics._COUNTER_STATS, *worker_metrics._GAUGE_STATS)}
    stats |= {"gate_perplexity_ratio": 1.01, "weight_bytes": 1e6, "lora_requests:support-bot": 3.0,
              "lora_loaded:support-bot": 1.0}
    exporter = worker_metrics.WorkerMetrics("m", runtime, lambda: stats)
    exposition = generate_latest(exporter.registry)
    assert promtool_lint(exposition) == ""
    series = f'inferplane_worker_lora_requests_total{{adapter="support-bot",model="m",runtime="{runtime}"}} 3.0'
    assert series.encode() in exposition
