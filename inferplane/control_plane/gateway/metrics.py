"""The gateway's own Prometheus metrics (the workers export the engine's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("inferplane_gateway_requests", "tenant API requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("inferplane_gateway_request_seconds", "time to the full response (or stream end)",
                                 ["route"], buckets=_BUCKETS, registry=self.registry)
        self.ttft = Histogram("inferplane_gateway_time_to_first_token_seconds", "time to the first streamed token",
                              ["model"], buckets=_BUCKETS, registry=self.registry)
        self.tokens = Counter("inferplane_gateway_tokens", "tokens served by kind", ["model", "kind"],
                              registry=self.registry)
        self.limiter_store_errors = Counter("inferplane_gateway_limiter_store_errors",
                                            "rate-limit store (Redis) calls that failed", ["failure_mode"],
                                            registry=self.registry)
