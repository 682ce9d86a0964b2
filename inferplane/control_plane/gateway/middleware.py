"""Body-size limit and per-route metrics as a plain ASGI middleware.

This was an ``@app.middleware("http")`` function. Starlette runs those through
``BaseHTTPMiddleware``, which wraps every request in an anyio task group and memory streams; with
one-token requests that wrapping was the largest single cost of the gateway's event loop (about a
fifth of it, measured with py-spy under `inferplane bench gateway`). A plain ASGI callable does the
same job with two small closures. It also times the whole response: the wrapped version stopped the
clock when a streamed response *started*, while the metric is documented as "to the stream end".
"""

from __future__ import annotations

import time
from typing import Any

from inferplane.control_plane.gateway.errors import error_response
from inferplane.control_plane.gateway.metrics import GatewayMetrics

Scope = dict[str, Any]


class LimitsAndMetrics:
    def __init__(self, app, metrics: GatewayMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app raises before it responds

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            length = header(scope, b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                response = error_response(413, f"request body over {self.max_body_bytes} bytes",
                                          "request_too_large")
                await response(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) header in an ASGI scope, as Starlette's `Headers.get` gives it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
