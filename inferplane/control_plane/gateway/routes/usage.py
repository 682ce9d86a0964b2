"""`GET /v1/usage`: a tenant's own token usage, per model and minute, with totals and the limits that apply.

The rows come from the database, so the route is a plain `def` (FastAPI's thread pool); the
inference path never touches the database.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter

from inferplane.control_plane import usage
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway.routes.dependencies import (
    AdminCaller,
    Context,
    TenantCaller,
    require_platform_admin,
)

router = APIRouter()


@router.get("/v1/usage")
def get_usage(ctx: Context, principal: TenantCaller, days: int = 31):
    if principal.tenant_id is None:
        raise Forbidden("usage is per tenant; use a tenant's key")
    with ctx.sessions.begin() as session:
        rows = usage.query_usage(session, principal.tenant_id, start=_since(days))
    data = [{"model": r.model, "minute": r.minute.isoformat(), "requests": r.requests,
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens} for r in rows]
    totals = {"requests": sum(r.requests for r in rows), "prompt_tokens": sum(r.prompt_tokens for r in rows),
              "completion_tokens": sum(r.completion_tokens for r in rows)}
    return {"object": "list", "tenant": principal.tenant_id, "data": data, "totals": totals,
            "limits": _limits(ctx, principal)}


@router.get("/admin/v1/usage")
def admin_usage(ctx: Context, principal: AdminCaller, days: int = 31):
    """Every tenant's totals over the last `days` (a platform admin's; a tenant reads its own at /v1/usage)."""
    require_platform_admin(principal)
    with ctx.sessions.begin() as session:
        totals = usage.totals_by_tenant(session, start=_since(days))
    return {"object": "list", "days": _days(days), "data": [t.__dict__ for t in totals]}


def _days(days: int) -> int:
    """The days asked for, within one day and a year."""
    return max(1, min(days, 366))


def _since(days: int) -> datetime:
    return datetime.now(UTC) - timedelta(days=_days(days))


def _limits(ctx, principal) -> dict:
    """The limits that apply to the caller's requests, to read usage against (the console draws them
    beside its charts): its key's rates and sequences in flight, the band, the tenant's monthly quota."""
    quota = ctx.inference.quota
    monthly = quota.quota_of(principal.tenant_id) if quota is not None else None
    return {"requests_per_minute": principal.requests_per_minute, "tokens_per_minute": principal.tokens_per_minute,
            "max_concurrent_sequences": principal.max_concurrent_sequences,
            "tenant_max_concurrent_sequences": principal.tenant_max_concurrent_sequences,
            "priority": principal.priority or principal.tenant_priority,
            "monthly_token_quota": monthly,
            "monthly_tokens_used": quota.used(principal.tenant_id) if monthly is not None else None}
