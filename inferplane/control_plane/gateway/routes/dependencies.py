"""What every route asks for: the gateway's context and the authenticated caller, as FastAPI dependencies.

`create_app` keeps the one `GatewayContext` on `app.state.gateway`; routes reach it through
`Context` rather than a closure, so each router is a plain module-level `APIRouter` that any app
built by `create_app` can include.

Credential checks are in-memory (key cache, JWT signature): they are `async def` so that they run on
the event loop; a plain `def` dependency costs every request a hop through the thread pool.

What a caller may do once authenticated (`require_platform_admin`, `own_tenant`, `tenant_scope`)
are plain functions that handlers call, not dependencies: FastAPI solves dependencies before it
validates the query and the body, so a check there would answer a tenant admin's malformed request
with 403 where it is answered with 422 naming the field.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from inferplane.control_plane.auth import ALL_TENANTS, Principal, TenantScope
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway.console.sessions import COOKIE_NAME, CSRF_HEADER
from inferplane.control_plane.gateway.context import GatewayContext


async def gateway_context(request: Request) -> GatewayContext:
    """The context of the app serving this request (`create_app` puts it there)."""
    return request.app.state.gateway


Context = Annotated[GatewayContext, Depends(gateway_context)]


async def request_caller(ctx: GatewayContext, request: Request, authorization: str | None, *,
                         admin: bool) -> Principal:
    """Who sends `request`: its bearer `authorization`, or without one its console session cookie
    with the session's CSRF header (GatewayContext.authenticate)."""
    return await ctx.authenticate(authorization, request.cookies.get(COOKIE_NAME), request.headers.get(CSRF_HEADER),
                                  admin=admin)


async def tenant_caller(request: Request, ctx: Context, authorization: str | None = Header(default=None)) -> Principal:
    """The caller of the tenant API: an API key (401 without a valid one), or a tenant's console session."""
    return await request_caller(ctx, request, authorization, admin=False)


async def admin_caller(request: Request, ctx: Context, authorization: str | None = Header(default=None)) -> Principal:
    """The caller of the admin API: a platform admin (JWT or bootstrap key) or a tenant admin's key,
    or a console session signed in with one of those."""
    return await request_caller(ctx, request, authorization, admin=True)


TenantCaller = Annotated[Principal, Depends(tenant_caller)]
AdminCaller = Annotated[Principal, Depends(admin_caller)]


def require_platform_admin(principal: Principal) -> None:
    """403 unless `principal` administers the whole platform (not one tenant)."""
    if principal.tenant_id is not None:
        raise Forbidden("only a platform admin (JWT or bootstrap key) may do this")


def own_tenant(principal: Principal, tenant_id: str) -> str:
    """`tenant_id`, if `principal` may manage it (a platform admin: any; a tenant admin: its own), else 403."""
    if principal.tenant_id is not None and principal.tenant_id != tenant_id:
        raise Forbidden("a tenant admin manages its own tenant only")
    return tenant_id


def tenant_scope(principal: Principal) -> TenantScope:
    """The tenants `principal` sees: every one for a platform admin, its own for a tenant admin."""
    return ALL_TENANTS if principal.tenant_id is None else principal.tenant_id
