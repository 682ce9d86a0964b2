"""Requests in flight per replica, as this gateway sees them, plus what workers report.

Outstanding counts are exact and local (incremented on pick, decremented when the stream ends):
they drive the bounded-load rule and least-outstanding choice. With several gateway replicas each
sees only its share, so the gateway may also feed in the worker's own ``Stats`` ``num_waiting``;
that global queue figure only decides saturation, and is ignored once older than ``stats_ttl_s`` so
a worker that stopped answering ``Stats`` does not look saturated (or idle) forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class LoadTracker:
    def __init__(self, *, stats_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stats_ttl_s = stats_ttl_s
        self._clock = clock
        self._outstanding: dict[str, int] = {}
        self._waiting: dict[str, tuple[int, float]] = {}

    def outstanding(self, address: str) -> int:
        return self._outstanding.get(address, 0)

    def acquire(self, address: str) -> None:
        self._outstanding[address] = self._outstanding.get(address, 0) + 1

    def release(self, address: str) -> None:
        n = self._outstanding.get(address, 0) - 1
        if n > 0:
            self._outstanding[address] = n
        else:
            self._outstanding.pop(address, None)

    def report_waiting(self, address: str, num_waiting: int) -> None:
        """Feed ``StatsResponse.values["num_waiting"]`` of a worker."""
        self._waiting[address] = (int(num_waiting), self._clock())

    def waiting(self, address: str) -> int | None:
        """Last reported queue length, or None when unknown or stale."""
        entry = self._waiting.get(address)
        if entry is None or self._clock() - entry[1] > self.stats_ttl_s:
            return None
        return entry[0]
