"""`GET /v1/usage`: a tenant's own token usage, per model and minute, with totals.

The rows come from the database, so the route is a plain `def` (FastAPI's thread pool); the
inference path never touches the database.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter

from inferplane.control_plane import usage
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway.routes.dependencies import Context, TenantCaller

router = APIRouter()


@router.get("/v1/usage")
def get_usage(ctx: Context, principal: TenantCaller, days: int = 31):
    if principal.tenant_id is None:
        raise Forbidden("usage is per tenant; use a tenant's key")
    start = datetime.now(UTC) - timedelta(days=max(1, min(days, 366)))
    with ctx.sessions.begin() as session:
        rows = usage.query_usage(session, principal.tenant_id, start=start)
    data = [{"model": r.model, "minute": r.minute.isoformat(), "requests": r.requests,
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens} for r in rows]
    totals = {"requests": sum(r.requests for r in rows), "prompt_tokens": sum(r.prompt_tokens for r in rows),
              "completion_tokens": sum(r.completion_tokens for r in rows)}
    return {"object": "list", "tenant": principal.tenant_id, "data": data, "totals": totals}
