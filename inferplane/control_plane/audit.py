"""The audit log of admin actions.

Every mutating admin function in this package writes its audit row in the caller's transaction, so
an action and its record commit or roll back together: there is no audited action that did not
happen, and no unaudited one that did.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferplane.control_plane.orm import AuditLog, utcnow


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    tenant_id: str | None
    detail: dict[str, Any] | None


def record(
    session: Session,
    *,
    actor: str,
    action: str,
    target: str | None = None,
    tenant_id: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    """Adds an audit row; `actor` says who ("jwt:<sub>", "bootstrap", "key:<id>", "cli:<user>")."""
    if not actor:
        raise ValueError("an audited action needs an actor")
    session.add(
        AuditLog(at=utcnow(), actor=actor, action=action, target=target, tenant_id=tenant_id, detail=detail)
    )
    session.flush()


def list_entries(
    session: Session,
    *,
    tenant_id: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
) -> list[AuditEntry]:
    """Newest first. Platform admins only: filter by `tenant_id` to show one tenant's history."""
    query = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(AuditLog.tenant_id == tenant_id)
    if action is not None:
        query = query.where(AuditLog.action == action)
    if since is not None:
        query = query.where(AuditLog.at >= since)
    return [
        AuditEntry(r.id, r.at, r.actor, r.action, r.target, r.tenant_id, r.detail)
        for r in session.scalars(query)
    ]
