"""Per-key token buckets and the per-tenant monthly quota (fake clocks: no sleeping, no wall time)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.errors import QuotaExceeded, RateLimited, RequestTooLarge
from inferplane.control_plane.limits import KeyLimits, QuotaTracker, RateLimiter, next_month_start
from inferplane.control_plane.tenants import create_tenant, set_quota
from inferplane.control_plane.usage import UsageRecorder


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = KeyLimits(requests_per_minute=6)
    for _ in range(6):
        limiter.admit("k", limits)
    with pytest.raises(RateLimited) as e:
        limiter.admit("k", limits)
    assert e.value.status == 429 and e.value.retry_after == pytest.approx(10.0)  # 60 s / 6
    assert e.value.retry_after_header == "10"
    limiter.admit("other-key", limits)  # buckets are per key
    clock.now += 9.9
    with pytest.raises(RateLimited):
        limiter.admit("k", limits)
    clock.now += 0.1
    limiter.admit("k", limits)


def test_tokens_per_minute_with_refunds_and_post_hoc_charges() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = KeyLimits(tokens_per_minute=600)  # 10 tokens/s
    limiter.admit("k", limits, tokens=600)  # a reservation of the whole minute
    with pytest.raises(RateLimited):
        limiter.admit("k", limits, tokens=1)
    limiter.adjust("k", limits, -500)  # it used 100: the rest comes back
    limiter.admit("k", limits, tokens=500)
    limiter.adjust("k", limits, -10_000)  # a refund never fills the bucket beyond its capacity
    limiter.admit("k", limits, tokens=600)
    with pytest.raises(RateLimited):
        limiter.admit("k", limits, tokens=1)
    clock.now += 60
    limiter.admit("k", limits, tokens=100)
    limiter.adjust("k", limits, 800)  # more than reserved: the bucket is now 300 in debt
    with pytest.raises(RateLimited) as e:
        limiter.admit("k", limits, tokens=50)
    assert e.value.retry_after == pytest.approx(35.0)  # (300 + 50) / 10
    clock.now += 35
    limiter.admit("k", limits, tokens=50)
    with pytest.raises(RequestTooLarge) as too_large:
        limiter.admit("k", limits, tokens=601)
    assert too_large.value.status == 400


def test_refused_requests_take_nothing() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = KeyLimits(requests_per_minute=60, tokens_per_minute=60)
    limiter.admit("k", limits, tokens=60)
    for _ in range(5):  # refused on tokens: the request bucket must not be drained by the retries
        with pytest.raises(RateLimited):
            limiter.admit("k", limits, tokens=10)
    clock.now += 10
    limiter.admit("k", limits, tokens=10)


def test_unlimited_and_changed_limits() -> None:
    limiter = RateLimiter(clock=Clock())
    for _ in range(1000):
        limiter.admit("k", KeyLimits(), tokens=10**6)
    limiter.admit("k", KeyLimits(requests_per_minute=1))
    with pytest.raises(RateLimited):
        limiter.admit("k", KeyLimits(requests_per_minute=1))
    limiter.admit("k", KeyLimits(requests_per_minute=2))  # a new limit starts a fresh bucket
    limiter.forget("k")
    limiter.admit("k", KeyLimits(requests_per_minute=1))


def test_thread_safety_admits_exactly_the_capacity() -> None:
    limiter = RateLimiter(clock=Clock())  # frozen clock: no refill during the test
    limits = KeyLimits(requests_per_minute=500)
    admitted = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        n = 0
        for _ in range(200):
            try:
                limiter.admit("k", limits)
                n += 1
            except RateLimited:
                pass
        admitted.append(n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 500


def test_monthly_quota(sessions: sessionmaker[Session]) -> None:
    now = datetime(2025, 3, 31, 23, 0, tzinfo=UTC)
    with sessions.begin() as s:
        create_tenant(s, "acme", actor="test", monthly_token_quota=1000)
        create_tenant(s, "free", actor="test")
    recorder = UsageRecorder(sessions, now=lambda: now)
    # last month's usage does not count
    recorder.record(
        "acme", "m", prompt_tokens=5000, completion_tokens=0, at=datetime(2025, 2, 28, tzinfo=UTC)
    )
    recorder.record("acme", "m", prompt_tokens=400, completion_tokens=200)
    recorder.flush()
    tracker = QuotaTracker(sessions, recorder=recorder, now=lambda: now)
    tracker.refresh()
    assert tracker.used("acme") == 600 and tracker.remaining("acme") == 400
    tracker.check("acme")
    recorder.record("acme", "m", prompt_tokens=99, completion_tokens=0, at=datetime(2025, 2, 1, tzinfo=UTC))
    assert tracker.used("acme") == 600  # pending, but last month's
    recorder.record("acme", "m", prompt_tokens=300, completion_tokens=100)  # not flushed: still counts
    assert tracker.remaining("acme") == 0
    with pytest.raises(QuotaExceeded) as e:
        tracker.check("acme")
    assert e.value.status == 429 and e.value.retry_after == pytest.approx(3600.0)  # to April 1st
    recorder.flush()
    tracker.refresh()
    assert tracker.used("acme") == 1000  # flushed rows counted once, not twice
    tracker.check("free")  # no quota
    recorder.record("free", "m", prompt_tokens=10**9, completion_tokens=0)
    tracker.check("free")
    with sessions.begin() as s:
        set_quota(s, "acme", 5000, actor="test")
    tracker.refresh()
    tracker.check("acme")


def test_quota_reservations_count_until_released(sessions: sessionmaker[Session]) -> None:
    now = datetime(2025, 3, 15, tzinfo=UTC)
    with sessions.begin() as s:
        create_tenant(s, "acme", actor="test", monthly_token_quota=100)
    recorder = UsageRecorder(sessions, now=lambda: now)
    tracker = QuotaTracker(sessions, recorder=recorder, now=lambda: now)
    tracker.refresh()
    tracker.reserve("acme", 60)
    with pytest.raises(QuotaExceeded) as refused:
        tracker.reserve("acme", 41)
    assert "40" in str(refused.value)  # what is left is named
    tracker.reserve("acme", 40)
    recorder.record("acme", "m", prompt_tokens=5, completion_tokens=10)  # the 60 used 15 ...
    tracker.release("acme", 60)  # ... and gave its reservation back after the usage was recorded
    assert tracker.used("acme") == 55 and tracker.remaining("acme") == 45
    tracker.release("acme", 40)
    assert tracker.remaining("acme") == 85


def test_next_month_start() -> None:
    assert next_month_start(datetime(2024, 2, 10, 5, tzinfo=UTC)) == datetime(2024, 3, 1, tzinfo=UTC)
    assert next_month_start(datetime(2024, 12, 31, 23, 59, tzinfo=UTC)) == datetime(2025, 1, 1, tzinfo=UTC)
