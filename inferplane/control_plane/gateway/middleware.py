"""Body-size limit and per-route metrics as a plain ASGI middleware.

This was an ``@app.middleware("http")`` function. Starlette runs those through
``BaseHTTPMiddleware``, which wraps every request in an anyio task group and memory streams; with
one-token requests that wrapping was the largest single cost of the gateway's event loop (about a
fifth of it, measured with py-spy under `inferplane bench gateway`). A plain ASGI callable does the
same job with two small closures. It also times the whole response: the wrapped version stopped the
clock when a streamed response *started*, while the metric is documented as "to the stream end".

The body limit holds for every route, chunked or not, and before anything reads the body: FastAPI
reads a declared body before its dependencies check the caller's key, so counting only a
Content-Length let an unauthenticated chunked POST make the gateway buffer any size. `receive` is
wrapped instead: the bytes that actually arrive are counted, and the first message that crosses the
limit is not passed on. The client gets the 413 there and then; the app gets `http.disconnect`
(every ASGI consumer stops reading on it: the inference fast path, Starlette's `Request`), and what
it answers afterwards is dropped. The rest of the body is never read: the 413 says
`Connection: close`, and the server closes the connection after it.
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
                await self._too_large(scope, receive, send_status)
            else:
                await self._bounded(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)

    async def _bounded(self, scope: Scope, receive, send) -> None:
        """Runs the app with a `receive` that stops at `max_body_bytes` (see the module docstring)."""
        limit = self.max_body_bytes
        received = 0
        started = False  # the app's response has begun: too late for a 413, only the reading stops
        refused = False  # the limit was crossed: the app reads nothing more
        answered = False  # ... and the client has its 413

        async def bounded_receive():
            nonlocal received, refused, answered
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    refused = True
                    if not started:
                        answered = True
                        await self._too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def app_send(message) -> None:
            nonlocal started
            if answered:
                return  # the client has its 413; the app's answer to the cut-off body goes nowhere
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, bounded_receive, app_send)

    async def _too_large(self, scope: Scope, receive, send) -> None:
        # `Connection: close`: the rest of the body is still on its way, and a server keeping the
        # connection would read it all to find the next request (uvicorn does, discarding it).
        response = error_response(413, f"request body over {self.max_body_bytes} bytes", "request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) header in an ASGI scope, as Starlette's `Headers.get` gives it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
