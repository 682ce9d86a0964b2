"""`/admin/v1/tenants`: a platform admin lists, creates and changes tenants (quotas, key ceilings, flow control).

Admin bodies are strict and every string has a maximum length (admin_types: the limits, once);
integers the database stores as 64-bit stop at INT64_MAX. Either way a 422 naming the field.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from inferplane.api.priority import Band
from inferplane.control_plane import tenants
from inferplane.control_plane.gateway.admin_types import (
    DISPLAY_NAME_MAX_LENGTH,
    INT64_MAX,
    TENANT_ID_MAX_LENGTH,
    AdminBody,
)
from inferplane.control_plane.gateway.routes.dependencies import AdminCaller, Context, require_platform_admin

router = APIRouter()


class TenantIn(AdminBody):
    id: str = Field(min_length=1, max_length=TENANT_ID_MAX_LENGTH)
    display_name: str | None = Field(default=None, max_length=DISPLAY_NAME_MAX_LENGTH)
    monthly_token_quota: int | None = Field(default=None, ge=0, le=INT64_MAX)
    key_requests_per_minute_max: int | None = Field(default=None, gt=0, le=INT64_MAX)
    key_tokens_per_minute_max: int | None = Field(default=None, gt=0, le=INT64_MAX)
    priority: Band | None = None
    max_concurrent_sequences: int | None = Field(default=None, gt=0, le=tenants.SEQUENCE_LIMIT_MAX)


class TenantPatch(AdminBody):
    """Only the fields sent change; null removes a quota, a ceiling, a band or a limit."""

    monthly_token_quota: int | None = Field(default=None, ge=0, le=INT64_MAX)
    key_requests_per_minute_max: int | None = Field(default=None, gt=0, le=INT64_MAX)
    key_tokens_per_minute_max: int | None = Field(default=None, gt=0, le=INT64_MAX)
    priority: Band | None = None
    max_concurrent_sequences: int | None = Field(default=None, gt=0, le=tenants.SEQUENCE_LIMIT_MAX)


@router.get("/admin/v1/tenants")
def admin_list_tenants(ctx: Context, principal: AdminCaller):
    require_platform_admin(principal)
    with ctx.sessions.begin() as session:
        return {"data": [t.__dict__ for t in tenants.list_tenants(session)]}


@router.post("/admin/v1/tenants", status_code=201)
def admin_create_tenant(body: TenantIn, ctx: Context, principal: AdminCaller):
    require_platform_admin(principal)
    with ctx.sessions.begin() as session:
        info = tenants.create_tenant(session, body.id, actor=principal.actor, display_name=body.display_name,
                                     monthly_token_quota=body.monthly_token_quota,
                                     key_requests_per_minute_max=body.key_requests_per_minute_max,
                                     key_tokens_per_minute_max=body.key_tokens_per_minute_max,
                                     priority=body.priority, max_concurrent_sequences=body.max_concurrent_sequences)
        return info.__dict__


@router.patch("/admin/v1/tenants/{tenant_id}")
def admin_update_tenant(tenant_id: str, body: TenantPatch, ctx: Context, principal: AdminCaller):
    require_platform_admin(principal)
    sent = body.model_fields_set
    with ctx.sessions.begin() as session:
        info = tenants.get_tenant(session, tenant_id)
        if "monthly_token_quota" in sent:
            info = tenants.set_quota(session, tenant_id, body.monthly_token_quota, actor=principal.actor)
        if sent & {"key_requests_per_minute_max", "key_tokens_per_minute_max"}:
            info = tenants.set_key_ceilings(
                session, tenant_id, actor=principal.actor,
                requests_per_minute_max=body.key_requests_per_minute_max if "key_requests_per_minute_max" in sent
                else info.key_requests_per_minute_max,
                tokens_per_minute_max=body.key_tokens_per_minute_max if "key_tokens_per_minute_max" in sent
                else info.key_tokens_per_minute_max)
        if sent & {"priority", "max_concurrent_sequences"}:
            info = tenants.set_flow_control(
                session, tenant_id, actor=principal.actor,
                priority=body.priority if "priority" in sent else info.priority,
                max_concurrent_sequences=body.max_concurrent_sequences if "max_concurrent_sequences" in sent
                else info.max_concurrent_sequences)
    ctx.keys.refresh(full=True)
    return info.__dict__
