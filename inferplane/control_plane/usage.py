"""Usage accounting: buffered in memory on the request path, written to the `usage` table in batches.

`UsageRecorder.record()` only adds to a dict under a lock; a background thread flushes every
`flush_interval` seconds (and `stop()` flushes the rest). Rows are aggregated per (tenant, model,
minute) and written with an upsert that *adds* to what is there, so several gateway replicas, and
several flushes within one minute, sum up correctly. A failed flush keeps its rows for the next one.

What an abrupt end costs: a `kill -9` (or an OOM kill, a power loss) loses the usage recorded since
the last successful flush, so at most one `flush_interval` (2 s in a gateway) plus a flush in
progress; more only while the database is unreachable (then the rows wait in memory, and
`inferplane_usage_flush_last_success_timestamp_seconds` says since when). A stop (SIGTERM, SIGINT,
Ctrl-C) loses nothing: the gateway's stop calls `stop()`, which writes the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.errors import InvalidInput
from inferplane.control_plane.orm import Usage
from inferplane.control_plane.periodic import PeriodicThread

log = logging.getLogger(__name__)

_Slot = tuple[str, str, datetime]  # (tenant, model, minute)


@dataclass(frozen=True)
class UsageRow:
    tenant_id: str
    model: str
    minute: datetime
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _minute(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(second=0, microsecond=0)


def _upsert(session: Session, rows: dict[_Slot, list[int]]) -> None:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported databases
        raise RuntimeError(f"usage upsert is not implemented for {dialect}")
    for (tenant, model, minute), (requests, prompt, completion) in sorted(rows.items()):
        stmt = insert(Usage).values(
            tenant_id=tenant,
            model=model,
            minute=minute,
            requests=requests,
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[Usage.tenant_id, Usage.model, Usage.minute],
            set_={
                "requests": Usage.requests + stmt.excluded.requests,
                "prompt_tokens": Usage.prompt_tokens + stmt.excluded.prompt_tokens,
                "completion_tokens": Usage.completion_tokens + stmt.excluded.completion_tokens,
            },
        )
        session.execute(stmt)


class UsageRecorder:
    """Buffers usage in memory and flushes it in batches. Thread-safe; `record` never does I/O."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        flush_interval: float = 5.0,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self._sessions = sessions
        self.flush_interval = flush_interval
        self._now = now
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._buffer: dict[_Slot, list[int]] = {}
        self._in_flight: dict[_Slot, list[int]] = {}
        self._loop = PeriodicThread("inferplane-usage", lambda: self.flush_interval, self.flush,
                                    "usage flush failed; keeping the rows for the next flush")

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        """Stops the background thread and flushes what is left (call it at gateway shutdown)."""
        self._loop.stop(timeout=30)
        self.flush()

    def record(
        self,
        tenant_id: str,
        model: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        requests: int = 1,
        at: datetime | None = None,
    ) -> None:
        if min(prompt_tokens, completion_tokens, requests) < 0:
            raise InvalidInput("usage counts cannot be negative")
        slot = (tenant_id, model, _minute(at or self._now()))
        with self._lock:
            counts = self._buffer.setdefault(slot, [0, 0, 0])
            counts[0] += requests
            counts[1] += prompt_tokens
            counts[2] += completion_tokens

    @property
    def last_flush(self) -> float | None:
        """Unix time of the last flush that did not fail (None: none yet)."""
        return self._loop.last_success

    def pending_records(self) -> int:
        with self._lock:
            return len(self._buffer) + len(self._in_flight)

    def pending_tokens(self, tenant_id: str, *, since: datetime | None = None) -> int:
        """Tokens recorded for `tenant_id` (at or after `since`) and not yet committed; the quota
        tracker adds these to what the database says."""
        with self._lock:
            return sum(
                c[1] + c[2]
                for buf in (self._buffer, self._in_flight)
                for slot, c in buf.items()
                if slot[0] == tenant_id and (since is None or slot[2] >= since)
            )

    def flush(self) -> int:
        """Writes the buffer in one transaction; returns the number of rows upserted."""
        with self._flush_lock:
            with self._lock:
                batch, self._buffer = self._buffer, {}
                self._in_flight = batch
            if not batch:
                return 0
            try:
                with self._sessions.begin() as session:
                    _upsert(session, batch)
            except Exception:
                with self._lock:
                    for slot, counts in batch.items():
                        merged = self._buffer.setdefault(slot, [0, 0, 0])
                        for i in range(3):
                            merged[i] += counts[i]
                    self._in_flight = {}
                raise
            with self._lock:
                self._in_flight = {}
            return len(batch)


@dataclass(frozen=True)
class TenantTotals:
    tenant_id: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


def totals_by_tenant(session: Session, *, start: datetime) -> list[TenantTotals]:
    """Every tenant's usage summed since `start`, most tokens first: the platform admin's view
    across tenants (`GET /admin/v1/usage`, the console's tenants page), never a tenant's."""
    tokens = func.sum(Usage.prompt_tokens) + func.sum(Usage.completion_tokens)
    query = (select(Usage.tenant_id, func.sum(Usage.requests), func.sum(Usage.prompt_tokens),
                    func.sum(Usage.completion_tokens))
             .where(Usage.minute >= start).group_by(Usage.tenant_id).order_by(tokens.desc(), Usage.tenant_id))
    return [TenantTotals(tenant, int(requests or 0), int(prompt or 0), int(completion or 0))
            for tenant, requests, prompt, completion in session.execute(query)]


def query_usage(
    session: Session,
    tenant_id: str,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    model: str | None = None,
) -> list[UsageRow]:
    """One tenant's usage per model and minute in [start, end), oldest first (`GET /v1/usage`).

    `tenant_id` is mandatory: there is no way to ask this function for another tenant's rows.
    """
    if not tenant_id:
        raise InvalidInput("usage is always queried for one tenant")
    query = select(Usage).where(Usage.tenant_id == tenant_id).order_by(Usage.minute, Usage.model)
    if start is not None:
        query = query.where(Usage.minute >= start)
    if end is not None:
        query = query.where(Usage.minute < end)
    if model is not None:
        query = query.where(Usage.model == model)
    return [
        UsageRow(r.tenant_id, r.model, r.minute, r.requests, r.prompt_tokens, r.completion_tokens)
        for r in session.scalars(query)
    ]


def tokens_by_tenant(session: Session, *, since: datetime) -> dict[str, int]:
    """Total tokens per tenant since `since` (platform-internal: feeds the quota tracker)."""
    total = func.sum(Usage.prompt_tokens + Usage.completion_tokens)
    query = select(Usage.tenant_id, total).where(Usage.minute >= since).group_by(Usage.tenant_id)
    return {tenant: int(tokens or 0) for tenant, tokens in session.execute(query)}
