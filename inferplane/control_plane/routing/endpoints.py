"""Where a deployment's replicas are: the ``EndpointSource`` seam and its local implementation.

The router asks a source for a snapshot on every pick instead of subscribing to changes: a snapshot
is a cheap tuple read, the ring is cached per member set, and there is no callback ordering to get
wrong. The Kubernetes implementation lives in ``kube.py`` so this module imports nothing heavy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One worker replica. ``address`` ("host:port", IPv6 in brackets) is its identity everywhere:
    on the ring, in the health and load trackers, and as the gRPC target."""

    address: str
    name: str = ""  # pod or process name, for logs and metrics only

    def __str__(self) -> str:
        return self.address


@runtime_checkable
class EndpointSource(Protocol):
    """A deployment's current ready replicas."""

    def endpoints(self) -> tuple[Endpoint, ...]: ...


class StaticEndpointSource:
    """Endpoints set by hand: the local supervisor adds one when a worker process is up and removes
    it when the process exits; tests use it as a fixed list. Thread-safe because the supervisor may
    run its process watchers in threads while the gateway reads from the event loop."""

    def __init__(self, endpoints: Iterable[Endpoint | str] = ()) -> None:
        self._lock = threading.Lock()
        self._by_address: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self.set(endpoints)

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._snapshot

    def add(self, endpoint: Endpoint | str) -> None:
        ep = _as_endpoint(endpoint)
        with self._lock:
            self._by_address[ep.address] = ep
            self._publish()

    def remove(self, endpoint: Endpoint | str) -> None:
        address = endpoint.address if isinstance(endpoint, Endpoint) else endpoint
        with self._lock:
            self._by_address.pop(address, None)
            self._publish()

    def set(self, endpoints: Iterable[Endpoint | str]) -> None:
        with self._lock:
            self._by_address = {ep.address: ep for ep in map(_as_endpoint, endpoints)}
            self._publish()

    def _publish(self) -> None:
        self._snapshot = tuple(self._by_address.values())


def _as_endpoint(value: Endpoint | str) -> Endpoint:
    return value if isinstance(value, Endpoint) else Endpoint(address=value)
