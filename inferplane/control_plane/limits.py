"""Rate limits per key (requests/min, tokens/min) and the monthly token quota per tenant.

Both are enforced from memory. Rate limits are token buckets per gateway replica (N replicas admit
up to N times a key's limit in the worst case; the router spreading load keeps it close to 1x).
The quota is global: `QuotaTracker` reads every tenant's month-to-date tokens from the usage table
in the background and adds what this replica has not flushed yet.

Token limits meet a problem: a request's completion length is known only at the end. So `admit`
takes the tokens known up front (the prompt) and `charge` adds the rest afterwards, which may drive
the bucket negative; the key then waits until it has paid the debt. Every refusal carries
`retry_after` (seconds) for the 429's `Retry-After` header.
"""

from __future__ import annotations

import calendar
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.errors import QuotaExceeded, RateLimited, RequestTooLarge
from inferplane.control_plane.periodic import PeriodicThread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None means unlimited. `Principal` from the key cache carries both."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


class TokenBucket:
    """Holds up to `capacity`, refills `capacity` per `period` seconds continuously. Not locked:
    `RateLimiter` serializes access."""

    def __init__(self, capacity: float, period: float, now: float):
        self.capacity = float(capacity)
        self.rate = self.capacity / period
        self.level = self.capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0 if it can now)."""
        self._refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Takes `amount` unconditionally (the level may go negative: a debt paid by waiting)."""
        self._refill(now)
        self.level -= amount


class RateLimiter:
    """Per-key request and token buckets, thread-safe. `clock` is injectable for tests."""

    def __init__(self, *, period: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self._period = period
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str, int], TokenBucket] = {}

    def _bucket(self, key_id: str, kind: str, capacity: int, now: float) -> TokenBucket:
        # The capacity is part of the dictionary key, so changing a key's limit starts a fresh bucket.
        slot = (key_id, kind, capacity)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = TokenBucket(capacity, self._period, now)
        return bucket

    def admit(self, key_id: str, limits: KeyLimits, *, tokens: int = 0) -> None:
        """Admits one request needing `tokens` now, or raises `RateLimited` (nothing taken then).

        `RequestTooLarge` (400) if `tokens` exceeds the per-minute budget: waiting would never help.
        """
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise RequestTooLarge(f"request needs {tokens} tokens; this key allows {tpm} tokens per minute")
        with self._lock:
            now = self._clock()
            req = self._bucket(key_id, "req", rpm, now) if rpm is not None else None
            tok = self._bucket(key_id, "tok", tpm, now) if tpm is not None else None
            wait_req = req.wait_for(1, now) if req else 0.0
            wait_tok = tok.wait_for(max(tokens, 0), now) if tok else 0.0
            if wait_req > 0:
                raise RateLimited(f"rate limit of {rpm} requests per minute reached", retry_after=wait_req)
            if wait_tok > 0:
                raise RateLimited(
                    f"rate limit of {tpm} tokens per minute reached", retry_after=max(wait_req, wait_tok)
                )
            if req:
                req.take(1, now)
            if tok and tokens > 0:
                tok.take(tokens, now)

    def charge(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        """Charges tokens learned after admission (completion tokens); never raises."""
        if limits.tokens_per_minute is None or tokens <= 0:
            return
        with self._lock:
            now = self._clock()
            self._bucket(key_id, "tok", limits.tokens_per_minute, now).take(tokens, now)

    def forget(self, key_id: str) -> None:
        """Drops a key's buckets (e.g. when it is revoked), so the map does not grow without bound."""
        with self._lock:
            for slot in [s for s in self._buckets if s[0] == key_id]:
                del self._buckets[slot]


def month_start(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month_start(at: datetime) -> datetime:
    start = month_start(at)
    days = calendar.monthrange(start.year, start.month)[1]
    return start + timedelta(days=days)


class QuotaTracker:
    """Month-to-date tokens per tenant against `tenants.monthly_token_quota`, checked from memory.

    `used(t)` = tokens in the usage table this month (read every `refresh_interval` s) + tokens this
    replica recorded but has not flushed yet (from the `UsageRecorder`). Other replicas' unflushed
    tokens are invisible until they flush, so a tenant can overrun its quota by a few seconds of
    traffic; a soft quota is the price of not blocking on the database.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        recorder: UsageRecorderLike | None = None,
        refresh_interval: float = 2.0,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self._sessions = sessions
        self._recorder = recorder
        self.refresh_interval = refresh_interval
        self._now = now
        self._quota: dict[str, int | None] = {}
        self._used: dict[str, int] = {}
        self._month: datetime | None = None
        self._loop = PeriodicThread("inferplane-quota", lambda: self.refresh_interval, self.refresh,
                                    "quota refresh failed; using the last known usage")

    def start(self) -> None:
        self.refresh()
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def refresh(self) -> None:
        from inferplane.control_plane.orm import Tenant
        from inferplane.control_plane.usage import tokens_by_tenant

        month = month_start(self._now())
        with self._sessions() as session:
            quotas = {t: q for t, q in session.execute(select(Tenant.id, Tenant.monthly_token_quota))}
            used = tokens_by_tenant(session, since=month)
        self._quota, self._used, self._month = quotas, used, month

    def used(self, tenant_id: str) -> int:
        month = month_start(self._now())
        pending = self._recorder.pending_tokens(tenant_id, since=month) if self._recorder is not None else 0
        stored = self._used.get(tenant_id, 0) if month == self._month else 0
        return stored + pending

    def remaining(self, tenant_id: str) -> int | None:
        """Tokens left this month; None if the tenant has no quota."""
        quota = self._quota.get(tenant_id)
        return None if quota is None else max(0, quota - self.used(tenant_id))

    def check(self, tenant_id: str) -> None:
        """Raises `QuotaExceeded` (429) with `retry_after` = seconds until the month rolls over."""
        remaining = self.remaining(tenant_id)
        if remaining is not None and remaining <= 0:
            now = self._now()
            wait = (next_month_start(now) - now).total_seconds()
            raise QuotaExceeded(
                f"tenant {tenant_id!r} has used its monthly quota of {self._quota[tenant_id]} tokens",
                retry_after=wait,
            )


class UsageRecorderLike(Protocol):
    """What `QuotaTracker` needs from `usage.UsageRecorder`."""

    def pending_tokens(self, tenant_id: str, *, since: datetime | None = None) -> int: ...
