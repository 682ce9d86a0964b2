"""The asyncio loop that POSTs pending deliveries to tenants' webhooks, signed, with retries.

It runs in every gateway process that has alert routing configured. The outbox is the database,
so nothing is held in memory between passes: pending rows left by a stopped or crashed process are
picked up by the next pass of any forwarder. The webhook endpoint wakes the loop as soon as it has
enqueued something; otherwise it sleeps until the earliest pending row is due, or `poll_interval`
(rows another replica enqueued, or whose lease ran out). Database work runs in threads, off the
event loop that serves requests.

A 2xx answer is a delivery; anything else (another status, a timeout, a refused connection) is
retried after `base_delay * 2**(attempts - 1)` seconds (at most `max_delay`) until `max_attempts`,
then the row is `failed`. Each attempt's status code or error is kept on the row and in the log;
the receiver's body is never read, and tenants see only an outcome class (see `store`): a webhook
URL must not become a way to read, or probe, other services.

Connections go through `outbound.GuardedAsyncTransport`: a webhook whose host resolves to an
internal address (loopback, private, link-local, metadata...) not in the operator's allow-list is
not contacted. That attempt is final (`failed` at once, its error marked refused): retrying a
policy decision would only repeat it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta

import httpx
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.alerts import outbox
from inferplane.control_plane.alerts.outbox import DueDelivery
from inferplane.control_plane.alerts.signing import DELIVERY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, signature
from inferplane.control_plane.orm import utcnow
from inferplane.control_plane.outbound import AddressNotAllowed, GuardedAsyncTransport, OutboundPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwarderSettings:
    base_delay: float = 1.0
    max_delay: float = 300.0
    max_attempts: int = 8
    poll_interval: float = 5.0
    timeout: float = 10.0  # per POST
    batch_size: int = 50  # deliveries claimed (and sent concurrently) per pass


@dataclass(frozen=True)
class _Outcome:
    delivery_id: int
    status_code: int | None
    error: str | None
    refused: bool = False  # the address was not allowed: nothing was sent


class AlertForwarder:
    def __init__(self, sessions: sessionmaker[Session], settings: ForwarderSettings | None = None, *,
                 outbound: OutboundPolicy | None = None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`outbound`: where webhooks may point besides public addresses (None: nowhere else).
        `transport` replaces the guarded one, and with it the address check: for tests only."""
        self.sessions = sessions
        self.settings = settings or ForwarderSettings()
        self.outbound = outbound or OutboundPolicy()
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        # Longer than one POST can take: a row is only claimed again once its holder must be gone.
        self._lease = timedelta(seconds=2 * self.settings.timeout + 30)

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after `attempts` failed attempts."""
        return min(self.settings.max_delay, self.settings.base_delay * 2 ** max(0, attempts - 1))

    def start(self) -> None:
        """Starts the loop on the running event loop (pending rows are delivered at once)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.create_task(self.run(), name="alert-forwarder")

    async def stop(self) -> None:
        """Stops the loop; a POST in flight is abandoned and its row comes due after its lease."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def wake(self) -> None:
        """Deliver now: something was enqueued. Safe from any thread; a no-op before `run` started."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            same_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            same_loop = False
        if same_loop:
            self._wakeup.set()
        else:
            loop.call_soon_threadsafe(self._wakeup.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            try:
                if await self.deliver_due():
                    continue  # more may be due (the next of an alert's deliveries, a full batch)
                delay = await asyncio.to_thread(self._seconds_to_next_due)
            except Exception:
                log.exception("delivering alerts failed; retrying in %.0f s", self.settings.poll_interval)
                delay = self.settings.poll_interval
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def deliver_due(self) -> int:
        """One pass: claims what is due, POSTs it, records the outcomes; returns how many it sent."""
        claimed = await asyncio.to_thread(self._claim)
        if not claimed:
            return 0
        outcomes = await asyncio.gather(*(self._send(d) for d in claimed))
        await asyncio.to_thread(self._record, outcomes)
        return len(claimed)

    def _claim(self) -> list[DueDelivery]:
        with self.sessions.begin() as session:
            return outbox.claim_due(session, utcnow(), lease=self._lease, limit=self.settings.batch_size)

    def _record(self, outcomes: list[_Outcome]) -> None:
        with self.sessions.begin() as session:
            for o in outcomes:
                state = outbox.record_attempt(session, o.delivery_id, status_code=o.status_code, error=o.error,
                                              now=utcnow(), max_attempts=self.settings.max_attempts,
                                              backoff=self.backoff, refused=o.refused)
                if state == "failed" and not o.refused:
                    log.warning("alert delivery %d failed for good after %d attempts: %s", o.delivery_id,
                                self.settings.max_attempts, o.error)

    def _seconds_to_next_due(self) -> float:
        with self.sessions() as session:
            due = outbox.next_due_at(session)
        if due is None:
            return self.settings.poll_interval
        return min(self.settings.poll_interval, max(0.0, (due - utcnow()).total_seconds()))

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            transport = self._transport or GuardedAsyncTransport(self.outbound)
            self._client = httpx.AsyncClient(timeout=self.settings.timeout, follow_redirects=False,
                                             transport=transport, trust_env=False,
                                             headers={"User-Agent": "inferplane-alert-forwarder"})
        return self._client

    async def _send(self, delivery: DueDelivery) -> _Outcome:
        body = json.dumps(delivery.body, separators=(",", ":"), sort_keys=True).encode()
        timestamp = int(time.time())
        headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: str(timestamp),
                   SIGNATURE_HEADER: signature(delivery.secret, timestamp, body), DELIVERY_HEADER: str(delivery.id)}
        try:
            async with self._http().stream("POST", delivery.url, content=body, headers=headers) as response:
                code = response.status_code  # the body is not read: see the module docstring
        except AddressNotAllowed as exc:
            log.warning("alert delivery %d to %s refused: %s", delivery.id, delivery.url, exc)
            return _Outcome(delivery.id, None, str(exc)[:500], refused=True)
        except Exception as exc:  # timeouts, refused connections, bad URLs: all retried the same way
            error = f"{type(exc).__name__}: {exc}"[:500]
            log.info("alert delivery %d (attempt %d) to %s: %s", delivery.id, delivery.attempt, delivery.url, error)
            return _Outcome(delivery.id, None, error)
        if 200 <= code < 300:
            return _Outcome(delivery.id, code, None)
        log.info("alert delivery %d (attempt %d) to %s: HTTP %d", delivery.id, delivery.attempt, delivery.url, code)
        return _Outcome(delivery.id, code, f"HTTP {code}")
