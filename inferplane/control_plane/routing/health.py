"""Which replicas may receive traffic.

Two signals feed one tracker. Passive: request outcomes reported by the gateway (a run of failures
before the first token ejects a replica, like Envoy's outlier detection). Active: ``grpc.health.v1``
checks, which are what brings an ejected replica back. A worker that says NOT_SERVING (draining) is
ejected at once: it asked for no new work. An ejected replica is retried after ``cooldown_s`` even
without a poller, so a gateway running without active checks never strands a recovered worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class _State:
    failures: int = 0
    successes: int = 0
    healthy: bool = True
    ejected_at: float = 0.0


class HealthTracker:
    """Per-address health. Unknown addresses are healthy: a new replica should get traffic as soon
    as discovery lists it as ready, not after a first poll."""

    def __init__(self, *, failure_threshold: int = 3, recovery_threshold: int = 1,
                 cooldown_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.recovery_threshold = recovery_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._states: dict[str, _State] = {}

    def _state(self, address: str) -> _State:
        return self._states.setdefault(address, _State())

    def is_healthy(self, address: str) -> bool:
        st = self._states.get(address)
        if st is None or st.healthy:
            return True
        return self._clock() - st.ejected_at >= self.cooldown_s

    def record_success(self, address: str) -> None:
        st = self._state(address)
        st.failures = 0
        st.successes += 1
        if not st.healthy and st.successes >= self.recovery_threshold:
            st.healthy = True
            log.info("replica %s is healthy again", address)

    def record_failure(self, address: str) -> None:
        st = self._state(address)
        st.successes = 0
        st.failures += 1
        if st.failures >= self.failure_threshold:
            self._eject(address, st)

    def mark_unhealthy(self, address: str) -> None:
        """Eject now (a NOT_SERVING answer, or the supervisor saw the process exit)."""
        st = self._state(address)
        st.successes = 0
        self._eject(address, st)

    def forget(self, address: str) -> None:
        self._states.pop(address, None)

    def _eject(self, address: str, st: _State) -> None:
        if st.healthy:
            log.warning("replica %s marked unhealthy", address)
        st.healthy = False
        st.ejected_at = self._clock()


class HealthPoller:
    """Polls ``grpc.health.v1.Health/Check`` on every endpoint the callback lists and feeds the
    tracker. One cached channel per address; channels of vanished addresses are closed."""

    def __init__(self, tracker: HealthTracker, addresses: Callable[[], Iterable[str]], *,
                 service: str = "", timeout_s: float = 1.0) -> None:
        self.tracker = tracker
        self._addresses = addresses
        self.service = service
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def check(self, address: str) -> bool:
        """One check; True when the worker answered SERVING."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=self.service),
                                    timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("health check of %s failed: %s", address, exc.code())
            self.tracker.record_failure(address)
            return False
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            self.tracker.record_success(address)
            return True
        self.tracker.mark_unhealthy(address)
        return False

    async def check_all(self) -> dict[str, bool]:
        addresses = sorted(set(self._addresses()))
        for gone in set(self._channels) - set(addresses):
            await self._channels.pop(gone).close()
        results = await asyncio.gather(*(self.check(a) for a in addresses))
        return dict(zip(addresses, results, strict=True))

    async def run(self, interval_s: float = 2.0) -> None:
        """Poll forever; cancel the task to stop (channels are closed on the way out)."""
        try:
            while True:
                try:
                    await self.check_all()
                except Exception:  # a bad address must not stop the checks of the others
                    log.exception("health polling round failed")
                await asyncio.sleep(interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()
