"""`/admin/v1/models` and `/admin/v1/adapters`: the model registry (weights and LoRA adapters) over the admin API.

Registry entries and errors: a tenant admin sees no server path (admin_views.py). The two
`.../resolve` routes are what the operator asks when it reconciles a deployment; only a platform
admin may. `DELETE /admin/v1/models/{ref}` never matches `resolve` (`_ModelRefConvertor`), so the
resolve route's Allow header does not list DELETE.
"""

from __future__ import annotations

import re
from typing import Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.convertors import PathConvertor, register_url_convertor

from inferplane.api.model_resolution import ModelResolutionError
from inferplane.control_plane import registry
from inferplane.control_plane.gateway.admin_types import (
    MODEL_NAME_MAX_LENGTH,
    MODEL_SOURCE_MAX_LENGTH,
    MODEL_VERSION_MAX_LENGTH,
    SHA256_HEX_LENGTH,
    AdminBody,
)
from inferplane.control_plane.gateway.admin_views import errors_redacted_for, registry_entry
from inferplane.control_plane.gateway.errors import error_response
from inferplane.control_plane.gateway.routes.dependencies import (
    AdminCaller,
    Context,
    require_platform_admin,
    tenant_scope,
)

router = APIRouter()


class ModelIn(AdminBody):
    source: str = Field(min_length=1, max_length=MODEL_SOURCE_MAX_LENGTH)
    name: str | None = Field(default=None, max_length=MODEL_NAME_MAX_LENGTH)
    version: str | None = Field(default=None, max_length=MODEL_VERSION_MAX_LENGTH)
    sha256: str | None = Field(default=None, max_length=SHA256_HEX_LENGTH)
    visibility: Literal["public", "private"] | None = None
    format: Literal["gguf", "hf"] | None = None  # needed for pvc:// sources, which the gateway cannot read


class AdapterIn(AdminBody):
    source: str = Field(min_length=1, max_length=MODEL_SOURCE_MAX_LENGTH)
    base: str = Field(min_length=1, max_length=MODEL_NAME_MAX_LENGTH + 1 + MODEL_VERSION_MAX_LENGTH)
    name: str | None = Field(default=None, max_length=MODEL_NAME_MAX_LENGTH)
    version: str | None = Field(default=None, max_length=MODEL_VERSION_MAX_LENGTH)
    sha256: str | None = Field(default=None, max_length=SHA256_HEX_LENGTH)


class _ModelRefConvertor(PathConvertor):
    """`{ref:model_ref}`: a model reference, which may hold '/' as `path` does, but never a reserved name
    (`resolve`): that path is `GET /admin/v1/models/resolve`'s, so DELETE does not match it there, nor
    show in the Allow header a 405 or an OPTIONS gets for it."""

    regex = "(?!(?:" + "|".join(map(re.escape, sorted(registry.RESERVED_NAMES))) + ")$).+"


register_url_convertor("model_ref", _ModelRefConvertor())  # before the DELETE route below compiles its path


@router.get("/admin/v1/models")
def admin_list_models(ctx: Context, principal: AdminCaller):
    with errors_redacted_for(principal), ctx.sessions.begin() as session:
        return {"data": [registry_entry(m, principal) for m in registry.list_models(session, tenant_scope(principal))]}


@router.post("/admin/v1/models", status_code=201)
def admin_register_model(body: ModelIn, ctx: Context, principal: AdminCaller):
    with errors_redacted_for(principal):
        source = registry.confine_source(body.source, ctx.model_roots, platform_admin=principal.tenant_id is None)
        with ctx.sessions.begin() as session:
            info = registry.register_model(session, source, actor=principal.actor, name=body.name,
                                           version=body.version, owner_tenant_id=principal.tenant_id,
                                           visibility=body.visibility, expected_sha256=body.sha256,
                                           model_format=body.format, outbound=ctx.outbound)
    return registry_entry(info, principal)


@router.get("/admin/v1/adapters")
def admin_list_adapters(ctx: Context, principal: AdminCaller):
    with errors_redacted_for(principal), ctx.sessions.begin() as session:
        adapters = registry.list_adapters(session, tenant_scope(principal))
        return {"data": [registry_entry(a, principal) for a in adapters]}


@router.get("/admin/v1/adapters/resolve")
def admin_resolve_adapter(name: str, ctx: Context, principal: AdminCaller, version: str | None = None):
    """What a deployment's `adapters` entry loads: the operator asks this when it reconciles."""
    require_platform_admin(principal)
    with ctx.sessions.begin() as session:
        try:
            return registry.resolve_adapter(session, name, version).to_dict()
        except ModelResolutionError as exc:
            return error_response(404, exc.message, "model_not_found", "name")


@router.post("/admin/v1/adapters", status_code=201)
def admin_register_adapter(body: AdapterIn, ctx: Context, principal: AdminCaller):
    """A LoRA adapter (PEFT folder) for a base model the caller can see; a tenant admin's is private."""
    with errors_redacted_for(principal):
        source = registry.confine_source(body.source, ctx.model_roots, platform_admin=principal.tenant_id is None)
        with ctx.sessions.begin() as session:
            info = registry.register_adapter(session, source, actor=principal.actor, base=body.base,
                                             name=body.name, version=body.version,
                                             owner_tenant_id=principal.tenant_id, expected_sha256=body.sha256,
                                             outbound=ctx.outbound)
    if ctx.refresh_adapters is not None:
        ctx.refresh_adapters()
    return registry_entry(info, principal)


@router.get("/admin/v1/models/resolve")
def admin_resolve_model(name: str, ctx: Context, principal: AdminCaller, version: str | None = None):
    """What a deployment naming `name` (and `version`) runs: the operator asks this when it reconciles."""
    require_platform_admin(principal)
    with ctx.sessions.begin() as session:
        try:
            return registry.resolve_for_deployment(session, name, version).to_dict()
        except ModelResolutionError as exc:
            status, code = (404, "model_not_found") if exc.reason == "ModelNotFound" else (409, "model_not_ready")
            return error_response(status, exc.message, code, "name")


@router.delete("/admin/v1/models/{ref:model_ref}")
def admin_delete_model(ref: str, ctx: Context, principal: AdminCaller):
    with errors_redacted_for(principal), ctx.sessions.begin() as session:
        deleted = registry.delete_model(session, tenant_scope(principal), ref, actor=principal.actor)
    return {"deleted": [m.ref for m in deleted]}
