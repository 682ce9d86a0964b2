"""Errors the gateway turns into client responses; typed so it can map each to one status.

Their messages reach tenants, so they never name a replica: its address is an attribute (`tried`,
`endpoint`) for the gateway's log (routing.retry logs each failure with it), not part of the text.
"""

from __future__ import annotations


class RoutingError(Exception):
    """Base of the routing errors."""


class UnknownModel(RoutingError):
    """No route for the served model name (REST 404, gRPC NOT_FOUND)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"no deployment serves model {model!r}")
        self.model = model


class NoReplicaAvailable(RoutingError):
    """Every replica is unhealthy, absent or already tried (REST 503, gRPC UNAVAILABLE)."""

    def __init__(self, model: str, tried: tuple[str, ...] = ()) -> None:
        detail = f" (tried {len(tried)} replica(s))" if tried else ""
        super().__init__(f"no replica available for model {model!r}{detail}")
        self.model = model
        self.tried = tried


class StreamBrokenAfterStart(RoutingError):
    """The worker failed after tokens reached the client. Not retried: a second replica would
    re-send text the client already has. The gateway ends the stream with an error event."""

    def __init__(self, endpoint: str, items_sent: int) -> None:
        super().__init__(f"a replica failed after {items_sent} streamed message(s)")
        self.endpoint = endpoint
        self.items_sent = items_sent
