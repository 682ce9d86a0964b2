"""The delivery outbox: which deliveries are due, claiming them, and recording each attempt.

Claiming is a conditional UPDATE that moves `next_attempt_at` past a lease and counts the attempt,
so on both databases exactly one forwarder (of however many gateway replicas) wins a row, and a
forwarder that dies mid-send leaves a row that comes due again when the lease runs out: delivery
is at least once, and receivers can drop repeats by the delivery id. A delivery waits while an
earlier one of the same alert to the same URL is pending, so a receiver never hears "resolved"
before "firing".

An attempt the address policy refused (see `control_plane.outbound`) ends the delivery at once, and
its error is kept with the `REFUSED_PREFIX`: that is how `store` tells tenants "refused" from
"failed" without a column of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, exists, func, select, update
from sqlalchemy.orm import Session, aliased

from inferplane.control_plane.orm import Alert, AlertDelivery, TenantWebhook

REFUSED_PREFIX = "refused: "


@dataclass(frozen=True)
class DueDelivery:
    """A claimed delivery: where to send what, and the secret to sign it with."""

    id: int
    url: str
    secret: str
    attempt: int  # this attempt's number, from 1
    body: dict[str, Any]


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat().replace("+00:00", "Z")


def alert_body(alert: Alert, status: str) -> dict[str, Any]:
    """What a tenant's webhook receives: the alert as it stood at this delivery's transition."""
    return {"fingerprint": alert.fingerprint, "status": status, "labels": alert.labels,
            "annotations": alert.annotations, "startsAt": _iso(alert.starts_at),
            "endsAt": _iso(alert.ends_at) if status == "resolved" else None,
            "generatorURL": alert.generator_url, "tenant": alert.tenant_id}


def _sendable() -> Any:
    """Pending, and not waiting behind an earlier pending delivery of the same alert to the same URL."""
    earlier = aliased(AlertDelivery)
    blocked = exists().where(earlier.alert_id == AlertDelivery.alert_id,
                             earlier.webhook_url == AlertDelivery.webhook_url,
                             earlier.state == "pending", earlier.id < AlertDelivery.id)
    return and_(AlertDelivery.state == "pending", ~blocked)


def claim_due(session: Session, now: datetime, *, lease: timedelta, limit: int = 50) -> list[DueDelivery]:
    ids = session.scalars(select(AlertDelivery.id)
                          .where(_sendable(), AlertDelivery.next_attempt_at <= now)
                          .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id).limit(limit)).all()
    claimed: list[DueDelivery] = []
    for delivery_id in ids:
        won = session.execute(
            update(AlertDelivery)
            .where(AlertDelivery.id == delivery_id, AlertDelivery.state == "pending",
                   AlertDelivery.next_attempt_at <= now)
            .values(next_attempt_at=now + lease, attempts=AlertDelivery.attempts + 1, last_attempt_at=now)
            .execution_options(synchronize_session=False)).rowcount == 1
        if not won:
            continue  # another forwarder took it
        row, alert, hook = session.execute(
            select(AlertDelivery, Alert, TenantWebhook)
            .join(Alert, Alert.id == AlertDelivery.alert_id)
            .outerjoin(TenantWebhook, TenantWebhook.id == AlertDelivery.webhook_id)
            .where(AlertDelivery.id == delivery_id).execution_options(populate_existing=True)).one()
        if hook is None:
            row.state, row.next_attempt_at = "failed", None
            row.last_error = "the webhook was removed before the alert could be delivered"
            continue
        claimed.append(DueDelivery(row.id, hook.url, hook.secret, row.attempts, alert_body(alert, row.alert_status)))
    session.flush()
    return claimed


def record_attempt(session: Session, delivery_id: int, *, status_code: int | None, error: str | None,
                   now: datetime, max_attempts: int, backoff: Callable[[int], float],
                   refused: bool = False) -> str | None:
    """Records one attempt's outcome (a 2xx status code is a delivery; `refused`: the address was
    not allowed, final at once); returns the new state, or None when the row is gone (its alert or
    tenant was deleted meanwhile)."""
    row = session.get(AlertDelivery, delivery_id)
    if row is None or row.state != "pending":
        return None if row is None else row.state
    row.last_status_code = status_code
    if refused:
        row.state, row.next_attempt_at, row.last_error = "failed", None, REFUSED_PREFIX + (error or "")
    elif status_code is not None and 200 <= status_code < 300:
        row.state, row.delivered_at, row.next_attempt_at, row.last_error = "delivered", now, None, None
    elif row.attempts >= max_attempts:
        row.state, row.next_attempt_at, row.last_error = "failed", None, error
    else:
        row.next_attempt_at, row.last_error = now + timedelta(seconds=backoff(row.attempts)), error
    session.flush()
    return row.state


def next_due_at(session: Session) -> datetime | None:
    """When the earliest sendable delivery comes due (None: nothing pending). Deliveries waiting
    behind another do not count: their time has often passed, and counting it would spin the loop."""
    return session.scalar(select(func.min(AlertDelivery.next_attempt_at)).where(_sendable()))
