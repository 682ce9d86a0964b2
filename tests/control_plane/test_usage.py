"""Usage: buffered, aggregated per (tenant, model, minute), upserted additively, queried per tenant."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.db import init_db, make_engine, session_factory, upgrade
from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.usage import UsageRecorder, query_usage

T0 = datetime(2025, 5, 1, 12, 0, 10, tzinfo=UTC)


def test_aggregation_and_additive_flushes(sessions: sessionmaker[Session]) -> None:
    a = UsageRecorder(sessions, now=lambda: T0)
    b = UsageRecorder(sessions, now=lambda: T0)  # a second gateway replica
    a.record("acme", "chat", prompt_tokens=10, completion_tokens=5)
    a.record("acme", "chat", prompt_tokens=1, completion_tokens=2, at=T0 + timedelta(seconds=40))
    a.record("acme", "chat", prompt_tokens=7, completion_tokens=0, at=T0 + timedelta(seconds=60))
    a.record("acme", "embed", prompt_tokens=3, completion_tokens=0)
    assert a.pending_tokens("acme") == 28 and a.pending_tokens("globex") == 0
    assert a.flush() == 3  # three (model, minute) slots
    assert a.pending_tokens("acme") == 0 and a.flush() == 0
    b.record("acme", "chat", prompt_tokens=100, completion_tokens=50)
    a.record("acme", "chat", prompt_tokens=1000, completion_tokens=0)
    b.flush()
    a.flush()
    with sessions() as s:
        rows = query_usage(s, "acme")
    minute = T0.replace(second=0)
    got = [(r.model, r.minute, r.requests, r.prompt_tokens, r.completion_tokens) for r in rows]
    assert got == [
        ("chat", minute, 4, 1111, 57),
        ("embed", minute, 1, 3, 0),
        ("chat", minute + timedelta(minutes=1), 1, 7, 0),
    ]
    with sessions() as s:
        assert [r.total_tokens for r in query_usage(s, "acme", model="embed")] == [3]
        assert len(query_usage(s, "acme", start=minute + timedelta(minutes=1))) == 1
        assert len(query_usage(s, "acme", end=minute + timedelta(minutes=1))) == 2


def test_usage_is_per_tenant(sessions: sessionmaker[Session]) -> None:
    r = UsageRecorder(sessions, now=lambda: T0)
    r.record("acme", "chat", prompt_tokens=1, completion_tokens=1)
    r.record("globex", "chat", prompt_tokens=9, completion_tokens=9)
    r.flush()
    with sessions() as s:
        assert {u.tenant_id for u in query_usage(s, "acme")} == {"acme"}
        assert [u.prompt_tokens for u in query_usage(s, "globex")] == [9]
        with pytest.raises(InvalidInput):
            query_usage(s, "")


def test_stop_flushes_and_background_thread_runs(sessions: sessionmaker[Session]) -> None:
    r = UsageRecorder(sessions, flush_interval=3600, now=lambda: T0)
    r.start()
    r.record("acme", "chat", prompt_tokens=2, completion_tokens=3)
    r.stop()  # the interval never elapsed: stop() must flush
    with sessions() as s:
        assert [u.total_tokens for u in query_usage(s, "acme")] == [5]


def test_failed_flush_keeps_the_rows(tmp_path: Path) -> None:
    """Against a real database whose table does not exist yet: the flush fails, nothing is lost,
    and the next flush after the schema appears writes everything once."""
    url = f"sqlite:///{tmp_path / 'late.db'}"
    engine = make_engine(url)
    r = UsageRecorder(session_factory(engine), now=lambda: T0)
    r.record("acme", "chat", prompt_tokens=4, completion_tokens=1)
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a missing table
        r.flush()
    r.record("acme", "chat", prompt_tokens=1, completion_tokens=0)
    assert r.pending_tokens("acme") == 6
    upgrade(engine)
    assert r.flush() == 1
    with session_factory(engine)() as s:
        rows = query_usage(s, "acme")
    assert [(u.requests, u.prompt_tokens, u.completion_tokens) for u in rows] == [(2, 5, 1)]
    engine.dispose()


def test_negative_counts_are_refused(tmp_path: Path) -> None:
    engine = init_db(f"sqlite:///{tmp_path / 'x.db'}")
    r = UsageRecorder(session_factory(engine))
    with pytest.raises(InvalidInput):
        r.record("acme", "chat", prompt_tokens=-1, completion_tokens=0)
    engine.dispose()
