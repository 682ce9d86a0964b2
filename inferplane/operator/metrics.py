"""The operator's Prometheus metrics: that it runs (build info) and how its reconciles end.

The platform alerts "operator down" (the build-info series is gone) and "reconcile errors" read
these. Both result labels exist from the start, so an error ratio is defined before the first error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import metadata

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from inferplane.api import metric_names as m

RESULTS = ("ok", "error")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.build_info = Gauge(m.OPERATOR_BUILD_INFO, "1 while the operator runs", ["version"],
                                registry=self.registry)
        self.reconciles = Counter(m.OPERATOR_RECONCILES, "InferenceDeployment reconciles by result", ["result"],
                                  registry=self.registry)
        self.build_info.labels(_version()).set(1)
        for result in RESULTS:
            self.reconciles.labels(result)

    @contextlib.contextmanager
    def reconcile(self) -> Iterator[None]:
        """Counts the block as one reconcile: "error" if it raised (kopf retries those), else "ok"."""
        try:
            yield
        except BaseException:
            self.reconciles.labels("error").inc()
            raise
        self.reconciles.labels("ok").inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


def _version() -> str:
    try:
        return metadata.version("inferplane")
    except metadata.PackageNotFoundError:
        return "unknown"


METRICS = OperatorMetrics()
