"""Tenants: create, list, look up, set quota, key ceilings and flow control, delete (platform-admin
operations).

A tenant's key ceilings cap the rate limits any of its keys may have, so a tenant admin minting
keys cannot exceed what the platform sold the tenant (see auth.create_key and KeyCache). Its flow
control is a priority band (api/priority.py; a key's own band may lower it, never raise it) and a limit on the
sequences all its keys may have in flight at once (gateway: concurrency.py), so one tenant cannot
take every slot of a replica.

A tenant's id is a short slug chosen by the admin; it is the handle in CLIs, metrics and usage rows,
so it is validated strictly (lower-case, DNS-label-like) and never changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from inferplane.api.priority import BANDS, DEFAULT_BAND, band_rank
from inferplane.control_plane import audit
from inferplane.control_plane.errors import Conflict, InvalidInput, NotFound
from inferplane.control_plane.orm import Tenant, utcnow

TENANT_ID_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")


@dataclass(frozen=True)
class TenantInfo:
    id: str
    display_name: str | None
    monthly_token_quota: int | None
    created_at: datetime
    key_requests_per_minute_max: int | None = None
    key_tokens_per_minute_max: int | None = None
    priority: str | None = None
    max_concurrent_sequences: int | None = None


def _info(row: Tenant) -> TenantInfo:
    return TenantInfo(row.id, row.display_name, row.monthly_token_quota, row.created_at,
                      row.key_requests_per_minute_max, row.key_tokens_per_minute_max, row.priority,
                      row.max_concurrent_sequences)


# The columns are 32-bit INTEGERs; no replica runs anywhere near this many sequences anyway.
SEQUENCE_LIMIT_MAX = 2**31 - 1


def validate_sequence_limit(value: int | None) -> int | None:
    """A limit on sequences in flight (tenant's or key's): a positive integer, or None (no limit)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 < value <= SEQUENCE_LIMIT_MAX):
        raise InvalidInput(f"max_concurrent_sequences: must be a positive integer up to {SEQUENCE_LIMIT_MAX} or "
                           f"unset, got {value!r}", param="max_concurrent_sequences")
    return value


def validate_priority(priority: str | None) -> str | None:
    """A band name of api/priority.BANDS or None (unset); anything else is a 400 naming `priority`.
    Shared with auth.create_key: a key's band is checked by the same words."""
    if priority is None:
        return None
    try:
        if not isinstance(priority, str) or not priority:
            raise ValueError
        band_rank(priority)
    except ValueError:
        raise InvalidInput(f"priority: {priority!r} is not a band (expected one of {', '.join(BANDS)})",
                           param="priority") from None
    return priority


def validate_key_priority(priority: str | None, tenant_band: str | None, tenant_id: str) -> str | None:
    """A key's band: a band name (validate_priority) no more urgent than its tenant's, else a 400
    naming `priority`. Whoever makes the key (a tenant admin or the platform admin): to give a key a
    more urgent band, the platform admin raises the tenant's. A tenant without a band counts as the
    default band here (a deployment's band is unknown when a key is made); `resolve_band` caps every
    request as well, so rows this check never saw obey the same rule."""
    validate_priority(priority)
    if priority is not None and band_rank(priority) < band_rank(tenant_band):
        ceiling = tenant_band or f"{DEFAULT_BAND} (the default: the tenant has no band)"
        raise InvalidInput(f"priority: at most {ceiling} for tenant {tenant_id!r}, got {priority!r}; a key's band "
                           "may lower its tenant's, never raise it", param="priority")
    return priority


def _validate_ceiling(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise InvalidInput(f"{name} must be a positive integer or unset, got {value!r}")
    return value


def validate_tenant_id(tenant_id: str) -> str:
    if not isinstance(tenant_id, str) or not TENANT_ID_RE.match(tenant_id):
        raise InvalidInput(
            f"invalid tenant id {tenant_id!r}: use 1-64 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return tenant_id


def _validate_quota(quota: int | None) -> int | None:
    if quota is not None and (not isinstance(quota, int) or quota < 0):
        raise InvalidInput(f"monthly token quota must be a non-negative integer, got {quota!r}")
    return quota


def create_tenant(
    session: Session,
    tenant_id: str,
    *,
    actor: str,
    display_name: str | None = None,
    monthly_token_quota: int | None = None,
    key_requests_per_minute_max: int | None = None,
    key_tokens_per_minute_max: int | None = None,
    priority: str | None = None,
    max_concurrent_sequences: int | None = None,
) -> TenantInfo:
    """Raises `Conflict` if the id is taken. `monthly_token_quota=None` means unlimited."""
    validate_tenant_id(tenant_id)
    _validate_quota(monthly_token_quota)
    _validate_ceiling("key_requests_per_minute_max", key_requests_per_minute_max)
    _validate_ceiling("key_tokens_per_minute_max", key_tokens_per_minute_max)
    validate_priority(priority)
    validate_sequence_limit(max_concurrent_sequences)
    if session.get(Tenant, tenant_id) is not None:
        raise Conflict(f"tenant {tenant_id!r} already exists")
    row = Tenant(
        id=tenant_id, display_name=display_name, monthly_token_quota=monthly_token_quota, created_at=utcnow(),
        key_requests_per_minute_max=key_requests_per_minute_max, key_tokens_per_minute_max=key_tokens_per_minute_max,
        priority=priority, max_concurrent_sequences=max_concurrent_sequences,
    )
    session.add(row)
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="tenant.create",
        target=tenant_id,
        tenant_id=tenant_id,
        detail={"monthly_token_quota": monthly_token_quota,
                "key_requests_per_minute_max": key_requests_per_minute_max,
                "key_tokens_per_minute_max": key_tokens_per_minute_max,
                "priority": priority, "max_concurrent_sequences": max_concurrent_sequences},
    )
    return _info(row)


def set_key_ceilings(session: Session, tenant_id: str, *, actor: str, requests_per_minute_max: int | None,
                     tokens_per_minute_max: int | None) -> TenantInfo:
    """Sets (None: removes) the ceilings; existing keys above them are held to them from the next
    key-cache refresh."""
    _validate_ceiling("key_requests_per_minute_max", requests_per_minute_max)
    _validate_ceiling("key_tokens_per_minute_max", tokens_per_minute_max)
    return _set_columns(session, tenant_id, actor, "tenant.set_key_ceilings",
                        key_requests_per_minute_max=requests_per_minute_max,
                        key_tokens_per_minute_max=tokens_per_minute_max)


def set_flow_control(session: Session, tenant_id: str, *, actor: str, priority: str | None,
                     max_concurrent_sequences: int | None) -> TenantInfo:
    """Sets (None: removes) the tenant's band and its limit on sequences in flight; gateways apply
    them from their next key-cache refresh (requests already admitted keep what they were given)."""
    validate_priority(priority)
    validate_sequence_limit(max_concurrent_sequences)
    return _set_columns(session, tenant_id, actor, "tenant.set_flow_control", priority=priority,
                        max_concurrent_sequences=max_concurrent_sequences)


def _set_columns(session: Session, tenant_id: str, actor: str, action: str, **values: object) -> TenantInfo:
    """Writes already-validated columns of one tenant and audits them as one action."""
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    for column, value in values.items():
        setattr(row, column, value)
    session.flush()
    audit.record(session, actor=actor, action=action, target=tenant_id, tenant_id=tenant_id, detail=dict(values))
    return _info(row)


def get_tenant(session: Session, tenant_id: str) -> TenantInfo:
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    return _info(row)


def list_tenants(session: Session) -> list[TenantInfo]:
    return [_info(r) for r in session.scalars(select(Tenant).order_by(Tenant.id))]


def set_quota(session: Session, tenant_id: str, monthly_token_quota: int | None, *, actor: str) -> TenantInfo:
    _validate_quota(monthly_token_quota)
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    row.monthly_token_quota = monthly_token_quota
    session.flush()
    audit.record(
        session,
        actor=actor,
        action="tenant.set_quota",
        target=tenant_id,
        tenant_id=tenant_id,
        detail={"monthly_token_quota": monthly_token_quota},
    )
    return _info(row)


def delete_tenant(session: Session, tenant_id: str, *, actor: str) -> None:
    """Deletes the tenant with its keys and private models (cascade); usage and audit rows stay."""
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    session.delete(row)
    session.flush()
    audit.record(session, actor=actor, action="tenant.delete", target=tenant_id, tenant_id=tenant_id)
