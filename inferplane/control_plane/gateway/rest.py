"""The REST gateway: OpenAI-compatible tenant API, admin API and health (metrics: metrics.py).

Paths and bodies follow OpenAI's so the official `openai` client works unchanged against
`http://host:port/v1`. Database work (admin API, usage) runs in FastAPI's thread pool; the
inference path never touches the database.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, Header
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import Field
from starlette.convertors import PathConvertor, register_url_convertor

from inferplane.api.model_resolution import ModelResolutionError
from inferplane.api.priority import Band
from inferplane.control_plane import auth, registry, tenants, usage
from inferplane.control_plane.auth import ALL_TENANTS, SCOPE_MODELS_READ, Principal
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway.admin_types import (
    DISPLAY_NAME_MAX_LENGTH,
    INT64_MAX,
    KEY_NAME_MAX_LENGTH,
    MODEL_NAME_MAX_LENGTH,
    MODEL_SOURCE_MAX_LENGTH,
    MODEL_VERSION_MAX_LENGTH,
    SCOPE_MAX_LENGTH,
    SCOPES_MAX_ITEMS,
    SHA256_HEX_LENGTH,
    TENANT_ID_MAX_LENGTH,
    AdminBody,
)
from inferplane.control_plane.gateway.admin_views import errors_redacted_for, registry_entry
from inferplane.control_plane.gateway.alerts_api import alerts_router
from inferplane.control_plane.gateway.completions import Completions
from inferplane.control_plane.gateway.context import GatewayContext, bearer
from inferplane.control_plane.gateway.embeddings import Embeddings
from inferplane.control_plane.gateway.errors import ERROR_RESPONSES, error_response, install_error_handlers
from inferplane.control_plane.gateway.fast_path import InferenceFastPath
from inferplane.control_plane.gateway.middleware import LimitsAndMetrics
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

# Admin bodies are strict and every string has a maximum length (admin_types: the limits, once);
# integers the database stores as 64-bit stop at INT64_MAX. Either way a 422 naming the field.


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


register_url_convertor("model_ref", _ModelRefConvertor())


# With "stream": true the same operation answers with server-sent events; the schema describes
# one event (each `data` is a JSON chunk, an error object, or the final "[DONE]").
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAMABLE: dict[int | str, dict] = {200: {"description": "the completion (JSON), or with stream=true its chunks "
                                                            "as server-sent events",
                                            "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def create_asgi_app(ctx: GatewayContext):
    """What uvicorn serves: body-size limit and metrics around the inference fast path around the
    FastAPI app (which serves and documents everything else)."""
    api = create_app(ctx)
    routes = {route.path: route for route in api.routes if isinstance(route, APIRoute)}
    return LimitsAndMetrics(InferenceFastPath(api, ctx, routes), metrics=ctx.metrics, max_body_bytes=ctx.max_body_bytes)


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="inferplane gateway", version="0.1.0", responses=ERROR_RESPONSES,
                  description="OpenAI-compatible inference API with tenants, keys, quotas and routing.")
    install_error_handlers(app)
    app.include_router(alerts_router(ctx))

    # Credential checks are in-memory (key cache, JWT signature): `async def` keeps them on the event
    # loop; a plain `def` dependency costs every request a hop through the thread pool.
    async def tenant(authorization: str | None = Header(default=None)) -> Principal:
        return ctx.tenant_principal(bearer(authorization))

    async def admin(authorization: str | None = Header(default=None)) -> Principal:
        return ctx.admin_principal(bearer(authorization))

    def scope_of(principal: Principal):
        return ALL_TENANTS if principal.tenant_id is None else principal.tenant_id

    # -- health -------------------------------------------------------------------------------
    # No /metrics here: its series name tenants, keys and private adapters, and every tenant reaches
    # this port. The gateway serves them on its own metrics listener (metrics.metrics_asgi_app).

    @app.get("/healthz", include_in_schema=False)
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        router = ctx.inference.router
        healthy = [a for a in router.addresses() if router.health.is_healthy(a)]
        if not healthy:
            return JSONResponse({"status": "waiting for a healthy worker"}, status_code=503)
        return {"status": "ready", "workers": len(healthy)}

    # -- tenant API ---------------------------------------------------------------------------

    def _model_card(m) -> dict:
        card = {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owner_tenant or m.owned_by}
        if m.parent is not None:  # a LoRA adapter: the served model it runs on (vLLM's field)
            card["parent"] = m.parent
        return card

    @app.get("/v1/models")
    async def list_models(principal: Principal = Depends(tenant)):
        principal.require(SCOPE_MODELS_READ)
        return {"object": "list", "data": [_model_card(m) for m in ctx.catalog.visible(principal.tenant_id)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, principal: Principal = Depends(tenant)):
        principal.require(SCOPE_MODELS_READ)
        return _model_card(ctx.catalog.get(model_id, principal.tenant_id))

    # Documented here; served by the fast path in front of FastAPI (fast_path.py), which calls the
    # same Completions and Embeddings methods. These routes still answer when the app runs without the fast path.
    completions_api = Completions(ctx)

    @app.post("/v1/completions", responses=_STREAMABLE)
    async def completions(body: CompletionRequest, principal: Principal = Depends(tenant)):
        return await completions_api.text(body, principal)

    @app.post("/v1/chat/completions", responses=_STREAMABLE)
    async def chat_completions(body: ChatCompletionRequest, principal: Principal = Depends(tenant)):
        return await completions_api.chat(body, principal)

    embeddings_api = Embeddings(ctx)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, principal: Principal = Depends(tenant)):
        """OpenAI's embeddings, from a model deployed with kind: embedding."""
        return await embeddings_api.create(body, principal)

    @app.get("/v1/usage")
    def get_usage(days: int = 31, principal: Principal = Depends(tenant)):
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

    # -- admin API ----------------------------------------------------------------------------

    def _platform_admin(principal: Principal) -> None:
        if principal.tenant_id is not None:
            raise Forbidden("only a platform admin (JWT or bootstrap key) may do this")

    @app.get("/admin/v1/tenants")
    def admin_list_tenants(principal: Principal = Depends(admin)):
        _platform_admin(principal)
        with ctx.sessions.begin() as session:
            return {"data": [t.__dict__ for t in tenants.list_tenants(session)]}

    @app.post("/admin/v1/tenants", status_code=201)
    def admin_create_tenant(body: TenantIn, principal: Principal = Depends(admin)):
        _platform_admin(principal)
        with ctx.sessions.begin() as session:
            info = tenants.create_tenant(session, body.id, actor=principal.actor, display_name=body.display_name,
                                         monthly_token_quota=body.monthly_token_quota,
                                         key_requests_per_minute_max=body.key_requests_per_minute_max,
                                         key_tokens_per_minute_max=body.key_tokens_per_minute_max,
                                         priority=body.priority, max_concurrent_sequences=body.max_concurrent_sequences)
            return info.__dict__

    @app.patch("/admin/v1/tenants/{tenant_id}")
    def admin_update_tenant(tenant_id: str, body: TenantPatch, principal: Principal = Depends(admin)):
        _platform_admin(principal)
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

    @app.get("/admin/v1/keys")
    def admin_list_keys(tenant_id: str | None = None, principal: Principal = Depends(admin)):
        scope = scope_of(principal) if tenant_id is None else _own(principal, tenant_id)
        with ctx.sessions.begin() as session:
            return {"data": [k.__dict__ for k in auth.list_keys(session, scope)]}

    def _own(principal: Principal, tenant_id: str) -> str:
        if principal.tenant_id is not None and principal.tenant_id != tenant_id:
            raise Forbidden("a tenant admin manages its own tenant only")
        return tenant_id

    @app.post("/admin/v1/keys", status_code=201)
    def admin_create_key(body: KeyIn, principal: Principal = Depends(admin)):
        tenant_id = body.tenant_id or principal.tenant_id
        if tenant_id is None:
            return error_response(422, "tenant_id: required for a platform admin", "invalid_value", "tenant_id")
        _own(principal, tenant_id)
        expires = timedelta(seconds=body.expires_in_seconds) if body.expires_in_seconds else None
        with ctx.sessions.begin() as session:
            created = auth.create_key(session, tenant_id, actor=principal.actor, scopes=body.scopes, name=body.name,
                                      expires_in=expires, requests_per_minute=body.requests_per_minute,
                                      tokens_per_minute=body.tokens_per_minute, priority=body.priority,
                                      max_concurrent_sequences=body.max_concurrent_sequences)
        ctx.keys.refresh()  # usable through this gateway at once; other replicas within a refresh interval
        return {"key": created.secret, **created.info.__dict__}

    @app.delete("/admin/v1/keys/{key_id}")
    def admin_revoke_key(key_id: str, principal: Principal = Depends(admin)):
        with ctx.sessions.begin() as session:
            info = auth.revoke_key(session, key_id, scope_of(principal), actor=principal.actor)
        ctx.keys.refresh()
        return info.__dict__

    # Registry entries and errors: a tenant admin sees no server path (admin_views.py).
    @app.get("/admin/v1/models")
    def admin_list_models(principal: Principal = Depends(admin)):
        with errors_redacted_for(principal), ctx.sessions.begin() as session:
            return {"data": [registry_entry(m, principal) for m in registry.list_models(session, scope_of(principal))]}

    @app.post("/admin/v1/models", status_code=201)
    def admin_register_model(body: ModelIn, principal: Principal = Depends(admin)):
        with errors_redacted_for(principal):
            source = registry.confine_source(body.source, ctx.model_roots, platform_admin=principal.tenant_id is None)
            with ctx.sessions.begin() as session:
                info = registry.register_model(session, source, actor=principal.actor, name=body.name,
                                               version=body.version, owner_tenant_id=principal.tenant_id,
                                               visibility=body.visibility, expected_sha256=body.sha256,
                                               model_format=body.format, outbound=ctx.outbound)
        return registry_entry(info, principal)

    @app.get("/admin/v1/adapters")
    def admin_list_adapters(principal: Principal = Depends(admin)):
        with errors_redacted_for(principal), ctx.sessions.begin() as session:
            adapters = registry.list_adapters(session, scope_of(principal))
            return {"data": [registry_entry(a, principal) for a in adapters]}

    @app.get("/admin/v1/adapters/resolve")
    def admin_resolve_adapter(name: str, version: str | None = None, principal: Principal = Depends(admin)):
        """What a deployment's `adapters` entry loads: the operator asks this when it reconciles."""
        _platform_admin(principal)
        with ctx.sessions.begin() as session:
            try:
                return registry.resolve_adapter(session, name, version).to_dict()
            except ModelResolutionError as exc:
                return error_response(404, exc.message, "model_not_found", "name")

    @app.post("/admin/v1/adapters", status_code=201)
    def admin_register_adapter(body: AdapterIn, principal: Principal = Depends(admin)):
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

    @app.get("/admin/v1/models/resolve")
    def admin_resolve_model(name: str, version: str | None = None, principal: Principal = Depends(admin)):
        """What a deployment naming `name` (and `version`) runs: the operator asks this when it reconciles."""
        _platform_admin(principal)
        with ctx.sessions.begin() as session:
            try:
                return registry.resolve_for_deployment(session, name, version).to_dict()
            except ModelResolutionError as exc:
                status, code = (404, "model_not_found") if exc.reason == "ModelNotFound" else (409, "model_not_ready")
                return error_response(status, exc.message, code, "name")

    @app.delete("/admin/v1/models/{ref:model_ref}")
    def admin_delete_model(ref: str, principal: Principal = Depends(admin)):
        with errors_redacted_for(principal), ctx.sessions.begin() as session:
            deleted = registry.delete_model(session, scope_of(principal), ref, actor=principal.actor)
        return {"deleted": [m.ref for m in deleted]}

    @app.get("/", include_in_schema=False)
    async def root():
        return PlainTextResponse("inferplane gateway: OpenAI-compatible API under /v1\n")

    return app

