"""The gateway's own Prometheus metrics (the workers export the engine's).

Request counters are bumped where things happen; the platform's state (database reachable, usage
flush lag, tenants' quota, replicas ready vs desired) is read by `PlatformCollector` at scrape
time, so it is never stale and costs nothing between scrapes. Names: `inferplane.api.metric_names`.

The series name tenants, API key ids and models (a tenant's private adapters among them), which is
what an operator's per-tenant dashboards and alerts need and no tenant may read. So they are served
by `metrics_asgi_app` on a listener of their own (the gateway's `--metrics-port`, which the Helm
chart opens to the monitoring namespace only), never on the API port that every tenant reaches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inferplane.api import metric_names as m

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
KEY_RESULTS = ("admitted", "rate_limited", "quota_exceeded", "concurrency_limited")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(m.GATEWAY_REQUESTS, "tenant API requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram(m.GATEWAY_LATENCY, "time to the full response (or stream end)",
                                 ["route"], buckets=_BUCKETS, registry=self.registry)
        self.ttft = Histogram(m.GATEWAY_TTFT, "time to the first streamed token",
                              ["model"], buckets=_BUCKETS, registry=self.registry)
        self.tokens = Counter(m.GATEWAY_TOKENS, "tokens served by kind", ["model", "kind"],
                              registry=self.registry)
        self.limiter_store_errors = Counter(m.GATEWAY_LIMITER_STORE_ERRORS,
                                            "rate-limit store (Redis) calls that failed", ["failure_mode"],
                                            registry=self.registry)
        self.key_requests = Counter(m.KEY_REQUESTS, "inference requests per API key by admission result",
                                    ["tenant", "key", "result"], registry=self.registry)
        self.tenant_tokens = Counter(m.TENANT_TOKENS, "tokens billed per tenant, model and kind",
                                     ["tenant", "model", "kind"], registry=self.registry)
        self.migrations = Counter(m.GATEWAY_MIGRATIONS, "streams moved to another replica mid-answer, by the "
                                  "failed call's status", ["cause"], registry=self.registry)
        self.disaggregation = Counter(m.GATEWAY_DISAGGREGATION, "requests to a disaggregated deployment by where "
                                      "their prompt was computed: prefilled (the prefill pool), decode_only (few "
                                      "uncached tokens), prefill_unavailable (no prefill replica answered), resumed "
                                      "(a migrated request)", ["outcome"], registry=self.registry)
        self.prefill_seconds = Histogram(m.GATEWAY_PREFILL_SECONDS, "time a disaggregated request spent in the "
                                         "prefill pool (queue, prompt, first token)", buckets=_BUCKETS,
                                         registry=self.registry)

    def key_admission(self, tenant: str | None, key: str, result: str) -> None:
        """Counts one admission decision; the key's other results start at 0, so a share is defined."""
        for other in KEY_RESULTS:
            self.key_requests.labels(tenant or "", key, other)
        self.key_requests.labels(tenant or "", key, result).inc()

    def billed(self, tenant: str, model: str, *, prompt_tokens: int, completion_tokens: int) -> None:
        self.tenant_tokens.labels(tenant, model, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, model, "completion").inc(completion_tokens)


@dataclass(frozen=True)
class ReplicaCount:
    model: str
    deployment: str
    ready: int
    desired: int


@dataclass
class PlatformSources:
    """Where the collector reads the platform's state; each callable is cheap and never blocks on I/O."""

    database_up: Callable[[], bool]
    usage_last_flush: Callable[[], float | None]  # unix time of the last successful flush (None: none yet)
    usage_pending: Callable[[], int]
    quotas: Callable[[], dict[str, tuple[int, int]]]  # tenant -> (quota, used) for tenants with a quota
    replicas: Callable[[], list[ReplicaCount]]
    # KV-aware routing: decisions by (policy, outcome), the index's blocks in all and per replica
    # and medium, and the KV event batches applied.
    routing_decisions: Callable[[], Mapping[tuple[str, str], int]] = dict
    kv_index_blocks: Callable[[], int] = lambda: 0
    kv_replica_blocks: Callable[[], Mapping[str, Mapping[str, int]]] = dict
    kv_event_batches: Callable[[], int] = lambda: 0


class PlatformCollector:
    def __init__(self, sources: PlatformSources, started: float | None = None) -> None:
        self.sources = sources
        self.started = time.time() if started is None else started

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families depend on the state at scrape time

    def collect(self) -> Iterator[Metric]:
        s = self.sources
        yield _gauge(m.DATABASE_UP, "1 while the control plane's database answers", value=float(s.database_up()))
        # Before the first flush the start time stands in, so a flush that never succeeds shows as lag.
        last = s.usage_last_flush()
        yield _gauge(m.USAGE_FLUSH_LAST_SUCCESS, "unix time of the last successful usage flush",
                     value=self.started if last is None else last)
        yield _gauge(m.USAGE_PENDING_RECORDS, "usage rows buffered and not yet written", value=s.usage_pending())
        quota = GaugeMetricFamily(m.TENANT_QUOTA_TOKENS, "monthly token quota", labels=["tenant"])
        used = GaugeMetricFamily(m.TENANT_QUOTA_USED_TOKENS, "tokens used this month, reservations included",
                                 labels=["tenant"])
        for tenant, (limit, spent) in sorted(s.quotas().items()):
            quota.add_metric([tenant], limit)
            used.add_metric([tenant], spent)
        yield quota
        yield used
        ready = GaugeMetricFamily(m.DEPLOYMENT_REPLICAS_READY, "replicas passing health checks",
                                  labels=["model", "deployment"])
        desired = GaugeMetricFamily(m.DEPLOYMENT_REPLICAS_DESIRED, "replicas the deployment asks for",
                                    labels=["model", "deployment"])
        for count in s.replicas():
            ready.add_metric([count.model, count.deployment], count.ready)
            desired.add_metric([count.model, count.deployment], count.desired)
        yield ready
        yield desired
        decisions = CounterMetricFamily(m.GATEWAY_ROUTING_DECISIONS, "replica choices by routing policy and outcome",
                                        labels=["policy", "outcome"])
        for (policy, outcome), count in sorted(s.routing_decisions().items()):
            decisions.add_metric([policy, outcome], count)
        yield decisions
        yield _gauge(m.GATEWAY_KV_INDEX_BLOCKS, "distinct KV blocks the index knows some replica holds",
                     value=s.kv_index_blocks())
        held = GaugeMetricFamily(m.GATEWAY_KV_INDEX_REPLICA_BLOCKS, "KV blocks a replica holds, per medium, "
                                 "as its KV events say", labels=["replica", "medium"])
        for replica, media in sorted(s.kv_replica_blocks().items()):
            for medium, count in sorted(media.items()):
                held.add_metric([replica, medium], count)
        yield held
        batches = CounterMetricFamily(m.GATEWAY_KV_EVENT_BATCHES, "KV event batches applied to the index")
        batches.add_metric([], s.kv_event_batches())
        yield batches


METRICS_PATH = "/metrics"
_NOT_FOUND = b"not found: this listener serves GET /metrics only\n"


def metrics_asgi_app(registry: CollectorRegistry):
    """The metrics listener's whole app: `GET /metrics` (prometheus_client's exposition, with its
    content negotiation and gzip), a 404 for anything else, so the port answers nothing but a scrape."""
    exposition = make_asgi_app(registry)

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == METRICS_PATH and scope["method"] in ("GET", "HEAD"):
            await exposition(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                (b"content-length", str(len(_NOT_FOUND)).encode())]})
        await send({"type": "http.response.body", "body": _NOT_FOUND})

    return app


def _gauge(name: str, documentation: str, *, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family
