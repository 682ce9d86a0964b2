"""Alerts as Alertmanager reports them: recorded by fingerprint, and listed per tenant.

Recording decides what counts as news. A new fingerprint, firing → resolved, and resolved → firing
with a later `startsAt` (the alert fired again) are transitions: each enqueues one delivery per
webhook of the alert's tenant, in the caller's transaction, so the alert row and its outbox rows
commit together. Alertmanager's repeats (same status, `repeat_interval`) update the row and enqueue
nothing; a firing notification older than the resolution already stored (a late retry from an
Alertmanager peer) does not reopen the alert.

Tenants see each delivery's outcome as a class only (`Outcome`): `delivered`, `refused` (the
address is not one the gateway connects to) or `failed`. The receiver's status code and the
connection error stay on the row and in the gateway's log, for the operator: shown to tenants they
would say whether a port on an address the tenant chose is open, closed or answering 401.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferplane.control_plane.alerts.outbox import REFUSED_PREFIX
from inferplane.control_plane.alerts.payload import AlertmanagerAlert, AlertmanagerWebhook
from inferplane.control_plane.alerts.webhooks import webhooks_by_tenant
from inferplane.control_plane.orm import Alert, AlertDelivery, Tenant, utcnow
from inferplane.control_plane.tenants import TENANT_ID_RE

log = logging.getLogger(__name__)

TENANT_LABEL = "tenant"

Outcome = Literal["delivered", "refused", "failed"]


@dataclass(frozen=True)
class Intake:
    """What one webhook call did: alerts in it, transitions among them, deliveries enqueued."""

    received: int
    transitions: int
    enqueued: int


@dataclass(frozen=True)
class DeliveryInfo:
    """A delivery as its tenant sees it: `outcome` is the last attempt's class (None: not tried yet)."""

    id: int
    webhook_url: str
    alert_status: str
    state: str
    outcome: Outcome | None
    attempts: int
    created_at: datetime
    next_attempt_at: datetime | None
    delivered_at: datetime | None


@dataclass(frozen=True)
class AlertInfo:
    id: int
    fingerprint: str
    tenant_id: str | None
    status: str
    labels: dict[str, Any]
    annotations: dict[str, Any]
    starts_at: datetime
    ends_at: datetime | None
    generator_url: str | None
    first_received_at: datetime
    last_received_at: datetime
    deliveries: tuple[DeliveryInfo, ...] = ()


def _insert(session: Session):
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two supported databases
        raise RuntimeError(f"alert intake is not implemented for {dialect}")
    return insert


def _tenant_of(session: Session, alert: AlertmanagerAlert, known: dict[str, bool]) -> str | None:
    """The `tenant` label when it names a tenant; else None (an unknown one is logged, not refused:
    refusing would make Alertmanager drop the whole group, platform alerts included)."""
    name = alert.labels.get(TENANT_LABEL)
    if not name:
        return None
    if name not in known:
        known[name] = bool(TENANT_ID_RE.match(name)) and session.get(Tenant, name) is not None
        if not known[name]:
            log.warning("alert %s (%r) names tenant %r, which does not exist: stored as a platform alert",
                        alert.fingerprint, alert.labels.get("alertname", "?")[:64], name[:64])
    return name if known[name] else None


def _record_one(session: Session, alert: AlertmanagerAlert, tenant_id: str | None, now: datetime) -> Alert | None:
    """Inserts or updates the alert's row; returns it when this notification is a transition."""
    insert = _insert(session)
    values = dict(tenant_id=tenant_id, status=alert.status, labels=alert.labels, annotations=alert.annotations,
                  starts_at=alert.startsAt, ends_at=alert.ends_at, generator_url=alert.generatorURL or None)
    # ON CONFLICT DO NOTHING: two gateway replicas receiving the same new alert both succeed, one inserts.
    table = Alert.__table__
    inserted = session.execute(insert(table).values(fingerprint=alert.fingerprint, first_received_at=now,
                                                    last_received_at=now, **values)
                               .on_conflict_do_nothing(index_elements=["fingerprint"])
                               .returning(table.c.id)).first() is not None
    # FOR UPDATE (PostgreSQL): concurrent notifications of one alert decide its transitions one at a time.
    row = session.scalars(select(Alert).where(Alert.fingerprint == alert.fingerprint).with_for_update()).one()
    if inserted:
        return row
    row.last_received_at = now
    if alert.startsAt < row.starts_at or (
            alert.startsAt == row.starts_at and alert.status == "firing" and row.status == "resolved"):
        return None  # about an earlier episode, or a late firing retry after the resolution we hold
    transition = alert.status != row.status or alert.startsAt > row.starts_at
    for name, value in values.items():  # the tenant too: it may have been created since
        setattr(row, name, value)
    return row if transition else None


def record_webhook(session: Session, payload: AlertmanagerWebhook, *, now: datetime | None = None) -> Intake:
    """Records every alert of a validated payload and enqueues the deliveries its transitions need."""
    now = now or utcnow()
    known: dict[str, bool] = {}
    transitions = enqueued = 0
    for alert in payload.alerts:
        tenant_id = _tenant_of(session, alert, known)
        row = _record_one(session, alert, tenant_id, now)
        if row is None:
            continue
        transitions += 1
        if tenant_id is None:
            continue
        for hook in webhooks_by_tenant(session, tenant_id):
            session.add(AlertDelivery(alert_id=row.id, webhook_id=hook.id, webhook_url=hook.url,
                                      alert_status=row.status, state="pending", attempts=0, created_at=now,
                                      next_attempt_at=now))
            enqueued += 1
    session.flush()
    return Intake(len(payload.alerts), transitions, enqueued)


def outcome(row: AlertDelivery) -> Outcome | None:
    """The class of a delivery's last attempt, from what the outbox recorded (see `outbox`)."""
    if row.state == "delivered":
        return "delivered"
    if row.last_error is None and row.last_status_code is None:
        return None  # not attempted yet, or the first attempt is in flight
    return "refused" if (row.last_error or "").startswith(REFUSED_PREFIX) else "failed"


def _delivery(row: AlertDelivery) -> DeliveryInfo:
    return DeliveryInfo(row.id, row.webhook_url, row.alert_status, row.state, outcome(row), row.attempts,
                        row.created_at, row.next_attempt_at, row.delivered_at)


def list_alerts(session: Session, tenant_id: str, *, status: str | None = None, limit: int = 100) -> list[AlertInfo]:
    """The tenant's alerts, newest first (by when they started firing), each with its deliveries."""
    query = select(Alert).where(Alert.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Alert.status == status)
    rows = list(session.scalars(query.order_by(Alert.starts_at.desc(), Alert.id.desc()).limit(limit)))
    deliveries: dict[int, list[DeliveryInfo]] = {}
    if rows:
        for d in session.scalars(select(AlertDelivery).where(AlertDelivery.alert_id.in_([r.id for r in rows]))
                                 .order_by(AlertDelivery.id)):
            deliveries.setdefault(d.alert_id, []).append(_delivery(d))
    return [AlertInfo(r.id, r.fingerprint, r.tenant_id, r.status, r.labels, r.annotations, r.starts_at, r.ends_at,
                      r.generator_url, r.first_received_at, r.last_received_at, tuple(deliveries.get(r.id, ())))
            for r in rows]
