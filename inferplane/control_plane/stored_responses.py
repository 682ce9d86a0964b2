"""The Responses API's stored answers (`store: true`), per tenant, in the control plane database.

One row holds an answer as it was returned and the conversation it answered (every earlier turn's
input items and this turn's), so continuing it (`previous_response_id`) reads one row, and deleting
an earlier response in a chain never breaks a later one. What keeps the table bounded:

  - a row lives RETENTION (30 days, as OpenAI keeps responses); an expired row is answered as a
    missing one, and `save` deletes the expired rows (the `expires_at` index finds them) at most
    once a PURGE_INTERVAL per process;
  - a conversation is stored only up to MAX_CONVERSATION_BYTES of JSON: the caller refuses a longer
    one with a 400 before anything is generated (`conversation_too_large`).

Another tenant's response is looked up with the tenant in the query, so it is missing exactly as an
unknown id is (a 404 that says nothing about other tenants). Like the other query modules here,
functions take a `Session` and never commit.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from inferplane.control_plane.orm import StoredResponse, utcnow

RETENTION = timedelta(days=30)
MAX_CONVERSATION_BYTES = 2 << 20  # 2 MiB of JSON: twice the default request body limit
PURGE_INTERVAL = 60.0  # seconds between one process's deletions of expired rows

_purge_lock = threading.Lock()
_last_purge = [float("-inf")]


@dataclass(frozen=True)
class ResponseRecord:
    id: str
    tenant_id: str
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    created_at: datetime
    expires_at: datetime


def conversation_bytes(items: list[dict[str, Any]]) -> int:
    """The size a conversation is bounded by: its compact JSON's UTF-8 bytes."""
    return len(json.dumps(items, separators=(",", ":"), ensure_ascii=False).encode())


def save(session: Session, tenant_id: str, response: dict[str, Any], conversation: list[dict[str, Any]], *,
         now: datetime | None = None) -> ResponseRecord:
    """Stores `response` (its `id` is the key) and the conversation it answered, for RETENTION."""
    now = now or utcnow()
    _purge_now_and_then(session, now)
    row = StoredResponse(id=response["id"], tenant_id=tenant_id, response=response, conversation=conversation,
                         created_at=now, expires_at=now + RETENTION)
    session.add(row)
    session.flush()
    return _record(row)


def get(session: Session, tenant_id: str, response_id: str, *, now: datetime | None = None) -> ResponseRecord | None:
    """The tenant's unexpired response `response_id`, else None (another tenant's included)."""
    row = session.execute(select(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
        StoredResponse.expires_at > (now or utcnow()))).scalar_one_or_none()
    return None if row is None else _record(row)


def remove(session: Session, tenant_id: str, response_id: str, *, now: datetime | None = None) -> bool:
    """Deletes the tenant's unexpired response `response_id`; False if there is none to delete."""
    result = session.execute(delete(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
        StoredResponse.expires_at > (now or utcnow())))
    return bool(result.rowcount)


def purge_expired(session: Session, *, now: datetime | None = None) -> int:
    """Deletes every expired row (every tenant's); how many."""
    result = session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= (now or utcnow())))
    return int(result.rowcount or 0)


def _purge_now_and_then(session: Session, now: datetime) -> None:
    with _purge_lock:
        if time.monotonic() - _last_purge[0] < PURGE_INTERVAL:
            return
        _last_purge[0] = time.monotonic()
    purge_expired(session, now=now)


def _record(row: StoredResponse) -> ResponseRecord:
    return ResponseRecord(id=row.id, tenant_id=row.tenant_id, response=row.response, conversation=row.conversation,
                          created_at=row.created_at, expires_at=row.expires_at)
