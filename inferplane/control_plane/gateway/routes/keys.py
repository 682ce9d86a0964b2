"""`/admin/v1/keys`: API keys, listed, created and revoked by a platform admin or a tenant's admin (its own tenant's).

A created or revoked key takes effect through this gateway at once (its key cache is refreshed);
other replicas see it within their refresh interval.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter
from pydantic import Field

from inferplane.api.priority import Band
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.admin_types import (
    INT64_MAX,
    KEY_NAME_MAX_LENGTH,
    SCOPE_MAX_LENGTH,
    SCOPES_MAX_ITEMS,
    TENANT_ID_MAX_LENGTH,
    AdminBody,
)
from inferplane.control_plane.gateway.errors import error_response
from inferplane.control_plane.gateway.routes.dependencies import AdminCaller, Context, own_tenant, tenant_scope

router = APIRouter()


class KeyIn(AdminBody):
    tenant_id: str | None = Field(default=None, max_length=TENANT_ID_MAX_LENGTH)
    name: str | None = Field(default=None, max_length=KEY_NAME_MAX_LENGTH)
    scopes: list[Annotated[str, Field(max_length=SCOPE_MAX_LENGTH)]] = Field(
        default_factory=lambda: list(auth.DEFAULT_SCOPES), max_length=SCOPES_MAX_ITEMS)
    expires_in_seconds: int | None = Field(default=None, gt=0, le=100 * 365 * 86400)
    requests_per_minute: int | None = Field(default=None, gt=0, le=INT64_MAX)
    tokens_per_minute: int | None = Field(default=None, gt=0, le=INT64_MAX)
    priority: Band | None = None
    max_concurrent_sequences: int | None = Field(default=None, gt=0, le=tenants.SEQUENCE_LIMIT_MAX)


@router.get("/admin/v1/keys")
def admin_list_keys(ctx: Context, principal: AdminCaller, tenant_id: str | None = None):
    scope = tenant_scope(principal) if tenant_id is None else own_tenant(principal, tenant_id)
    with ctx.sessions.begin() as session:
        return {"data": [k.__dict__ for k in auth.list_keys(session, scope)]}


@router.post("/admin/v1/keys", status_code=201)
def admin_create_key(body: KeyIn, ctx: Context, principal: AdminCaller):
    tenant_id = body.tenant_id or principal.tenant_id
    if tenant_id is None:
        return error_response(422, "tenant_id: required for a platform admin", "invalid_value", "tenant_id")
    own_tenant(principal, tenant_id)
    expires = timedelta(seconds=body.expires_in_seconds) if body.expires_in_seconds else None
    with ctx.sessions.begin() as session:
        created = auth.create_key(session, tenant_id, actor=principal.actor, scopes=body.scopes, name=body.name,
                                  expires_in=expires, requests_per_minute=body.requests_per_minute,
                                  tokens_per_minute=body.tokens_per_minute, priority=body.priority,
                                  max_concurrent_sequences=body.max_concurrent_sequences)
    ctx.keys.refresh()  # usable through this gateway at once; other replicas within a refresh interval
    return {"key": created.secret, **created.info.__dict__}


@router.delete("/admin/v1/keys/{key_id}")
def admin_revoke_key(key_id: str, ctx: Context, principal: AdminCaller):
    with ctx.sessions.begin() as session:
        info = auth.revoke_key(session, key_id, tenant_scope(principal), actor=principal.actor)
    ctx.keys.refresh()
    return info.__dict__
