"""Rate limits per key (requests/min, tokens/min) and the monthly token quota per tenant.

Token limits meet a problem: a request's completion length is known only at the end. So the
gateway reserves the most a request can cost at admission (prompt plus max_tokens) and refunds
what it did not use when it ends (`adjust` with a negative amount): a burst of concurrent requests
can never spend more than the limit, because each has paid for its worst case before it runs.
Every refusal carries `retry_after` (seconds) for the 429's `Retry-After` header.

Rate limits are token buckets. `RateLimiter` keeps them in this process (the embedded default:
N gateway replicas admit up to N times a key's limit); `shared_limits.RedisKeyLimiter` keeps them
in Redis so that they hold across replicas. The gateway talks to either through `KeyLimiter`.
The quota is global but soft: `QuotaTracker` reads every tenant's month-to-date tokens from the
usage table in the background, adds what this replica has not flushed yet and what its requests in
flight have reserved.
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

    def adjust(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        """Settles a request: takes `tokens` more, or refunds `-tokens` (up to a full bucket); never raises."""
        if limits.tokens_per_minute is None or tokens == 0:
            return
        with self._lock:
            now = self._clock()
            bucket = self._bucket(key_id, "tok", limits.tokens_per_minute, now)
            bucket.take(tokens, now)
            bucket.level = min(bucket.level, bucket.capacity)

    def forget(self, key_id: str) -> None:
        """Drops a key's buckets (e.g. when it is revoked), so the map does not grow without bound."""
        with self._lock:
            for slot in [s for s in self._buckets if s[0] == key_id]:
                del self._buckets[slot]


class KeyLimiter(Protocol):
    """What the gateway's request path needs from a rate limiter, wherever its buckets live."""

    async def admit(self, key_id: str, limits: KeyLimits, *, tokens: int) -> None: ...

    async def adjust(self, key_id: str, limits: KeyLimits, tokens: int) -> None: ...


class InProcessKeyLimiter:
    """`RateLimiter` behind `KeyLimiter`: the embedded default, limits per gateway replica."""

    def __init__(self, limiter: RateLimiter | None = None):
        self.limiter = limiter or RateLimiter()

    async def admit(self, key_id: str, limits: KeyLimits, *, tokens: int) -> None:
        self.limiter.admit(key_id, limits, tokens=tokens)

    async def adjust(self, key_id: str, limits: KeyLimits, tokens: int) -> None:
        self.limiter.adjust(key_id, limits, tokens)


def month_start(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month_start(at: datetime) -> datetime:
    start = month_start(at)
    days = calendar.monthrange(start.year, start.month)[1]
    return start + timedelta(days=days)


class QuotaTracker:
    """Month-to-date tokens per tenant against `tenants.monthly_token_quota`, checked from memory.

    `used(t)` = tokens in the usage table this month (read every `refresh_interval` s) + tokens this
    replica recorded but has not flushed yet (from the `UsageRecorder`) + tokens its requests in
    flight have reserved (`reserve`, given back by `release` once their usage is recorded). Other
    replicas' unflushed tokens are invisible until they flush, so concurrent traffic through several
    replicas can overrun a quota by a few seconds of it; a soft quota across replicas is the price of
    not blocking on the database. Through one replica it holds exactly.
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
        self._reserved: dict[str, int] = {}
        self._reserve_lock = threading.Lock()
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
        return stored + pending + self._reserved.get(tenant_id, 0)

    def quota_of(self, tenant_id: str) -> int | None:
        """The tenant's monthly token quota (None: none)."""
        return self._quota.get(tenant_id)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """(quota, used) of every tenant that has a quota, for the gateway's metrics."""
        return {tenant: (quota, self.used(tenant)) for tenant, quota in list(self._quota.items()) if quota is not None}

    def remaining(self, tenant_id: str) -> int | None:
        """Tokens left this month; None if the tenant has no quota."""
        quota = self._quota.get(tenant_id)
        return None if quota is None else max(0, quota - self.used(tenant_id))

    def check(self, tenant_id: str) -> None:
        """Raises `QuotaExceeded` (429) with `retry_after` = seconds until the month rolls over."""
        remaining = self.remaining(tenant_id)
        if remaining is not None and remaining <= 0:
            raise self.exceeded(tenant_id, f"tenant {tenant_id!r} has used its monthly quota of "
                                            f"{self._quota[tenant_id]} tokens")

    def reserve(self, tenant_id: str, tokens: int) -> None:
        """Holds `tokens` of the tenant's quota for a request in flight, or raises `QuotaExceeded`."""
        with self._reserve_lock:
            remaining = self.remaining(tenant_id)
            if remaining is not None and tokens > remaining:
                raise self.exceeded(tenant_id, f"the request may use {tokens} tokens and tenant {tenant_id!r} has "
                                                f"{remaining} of its monthly quota of {self._quota[tenant_id]} left")
            self._reserved[tenant_id] = self._reserved.get(tenant_id, 0) + tokens

    def release(self, tenant_id: str, tokens: int) -> None:
        """Gives a reservation back (after the request's real usage was recorded)."""
        with self._reserve_lock:
            left = self._reserved.get(tenant_id, 0) - tokens
            if left > 0:
                self._reserved[tenant_id] = left
            else:
                self._reserved.pop(tenant_id, None)

    def exceeded(self, tenant_id: str, message: str) -> QuotaExceeded:
        """The 429 for this tenant's quota: retry when the month rolls over."""
        now = self._now()
        return QuotaExceeded(message, retry_after=(next_month_start(now) - now).total_seconds())


class UsageRecorderLike(Protocol):
    """What `QuotaTracker` needs from `usage.UsageRecorder`."""

    def pending_tokens(self, tenant_id: str, *, since: datetime | None = None) -> int: ...
