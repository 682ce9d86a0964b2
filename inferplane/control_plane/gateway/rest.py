"""The REST gateway: OpenAI-compatible tenant API, admin API, health and metrics.

Paths and bodies follow OpenAI's so the official `openai` client works unchanged against
`http://host:port/v1`. Database work (admin API, usage) runs in FastAPI's thread pool; the
inference path never touches the database.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

from fastapi import Depends, FastAPI, Header
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from inferplane.control_plane import auth, registry, tenants, usage
from inferplane.control_plane.auth import ALL_TENANTS, SCOPE_MODELS_READ, Principal
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway.context import GatewayContext, bearer
from inferplane.control_plane.gateway.errors import ERROR_RESPONSES, error_response, install_error_handlers, sse_error
from inferplane.control_plane.gateway.inference import PreparedRequest
from inferplane.control_plane.gateway.middleware import LimitsAndMetrics
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from inferplane.v1 import worker_pb2


class TenantIn(BaseModel):
    id: str = Field(min_length=1)
    display_name: str | None = None
    monthly_token_quota: int | None = Field(default=None, ge=0)

class KeyIn(BaseModel):
    tenant_id: str | None = None
    name: str | None = None
    scopes: list[str] = Field(default_factory=lambda: list(auth.DEFAULT_SCOPES))
    expires_in_seconds: int | None = Field(default=None, gt=0)
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)

class ModelIn(BaseModel):
    source: str = Field(min_length=1)
    name: str | None = None
    version: str | None = None
    sha256: str | None = None
    visibility: str | None = None


def _usage(final: worker_pb2.GenerateResponse | None, prepared: PreparedRequest) -> dict:
    prompt = final.usage.prompt_tokens if final is not None else prepared.prompt_tokens
    completion = final.usage.completion_tokens if final is not None else 0
    cached = final.usage.cached_tokens if final is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_texts(prepared: PreparedRequest, ids) -> list[str]:
    return [prepared.model.tokenizer.decode([i], skip_special_tokens=False) for i in ids]


class _Collected:
    """A whole (non-streamed) generation gathered from the worker stream."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.final: worker_pb2.GenerateResponse | None = None

    def add(self, msg: worker_pb2.GenerateResponse) -> None:
        self.text.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        if msg.finished:
            self.final = msg


# With "stream": true the same operation answers with server-sent events; the schema describes
# one event (each `data` is a JSON chunk, an error object, or the final "[DONE]").
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_STREAMABLE: dict[int | str, dict] = {200: {"description": "the completion (JSON), or with stream=true its chunks "
                                                            "as server-sent events",
                                            "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="inferplane gateway", version="0.1.0", responses=ERROR_RESPONSES,
                  description="OpenAI-compatible inference API with tenants, keys, quotas and routing.")
    install_error_handlers(app)
    app.add_middleware(LimitsAndMetrics, metrics=ctx.metrics, max_body_bytes=ctx.max_body_bytes)

    # Credential checks are in-memory (key cache, JWT signature): `async def` keeps them on the event
    # loop; a plain `def` dependency costs every request a hop through the thread pool.
    async def tenant(authorization: str | None = Header(default=None)) -> Principal:
        return ctx.tenant_principal(bearer(authorization))

    async def admin(authorization: str | None = Header(default=None)) -> Principal:
        return ctx.admin_principal(bearer(authorization))

    def scope_of(principal: Principal):
        return ALL_TENANTS if principal.tenant_id is None else principal.tenant_id

    # -- health and metrics -------------------------------------------------------------------

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

    @app.get("/metrics", include_in_schema=False)
    async def metrics():
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- tenant API ---------------------------------------------------------------------------

    def _model_card(m) -> dict:
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": m.owner_tenant or m.owned_by}

    @app.get("/v1/models")
    async def list_models(principal: Principal = Depends(tenant)):
        principal.require(SCOPE_MODELS_READ)
        return {"object": "list", "data": [_model_card(m) for m in ctx.catalog.visible(principal.tenant_id)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, principal: Principal = Depends(tenant)):
        principal.require(SCOPE_MODELS_READ)
        return _model_card(ctx.catalog.get(model_id, principal.tenant_id))

    async def _open(prepared: PreparedRequest, params: worker_pb2.SamplingParams):
        """Starts the worker stream and waits for its first message, so that failures before
        the first token still become a proper HTTP status instead of a broken stream."""
        stream = ctx.inference.stream(prepared, params)
        start = time.perf_counter()
        first = await anext(stream)
        ctx.metrics.ttft.labels(prepared.model.name).observe(time.perf_counter() - start)
        return first, stream

    async def _collect(prepared, params) -> _Collected:
        first, stream = await _open(prepared, params)
        collected = _Collected()
        collected.add(first)
        async for msg in stream:
            collected.add(msg)
        _count_tokens(prepared, collected.final)
        return collected

    def _count_tokens(prepared: PreparedRequest, final) -> None:
        if final is not None:
            ctx.metrics.tokens.labels(prepared.model.name, "prompt").inc(final.usage.prompt_tokens)
            ctx.metrics.tokens.labels(prepared.model.name, "completion").inc(final.usage.completion_tokens)

    def _sse(prepared, first, stream, chunk, final_chunk, include_usage: bool) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            final = None
            try:
                msg = first
                while True:
                    if msg.text or msg.token_ids:
                        yield f"data: {json.dumps(chunk(msg))}\n\n"
                    if msg.finished:
                        final = msg
                        yield f"data: {json.dumps(final_chunk(msg))}\n\n"
                        break
                    msg = await anext(stream)
            except Exception as exc:  # broken after the stream started: a clean error event
                yield sse_error(exc)
                return
            finally:
                await stream.aclose()
            _count_tokens(prepared, final)
            if include_usage:
                yield f"data: {json.dumps(final_chunk(final, usage_only=True))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions", responses=_STREAMABLE)
    async def completions(body: CompletionRequest, principal: Principal = Depends(tenant)):
        prepared = ctx.inference.prepare(principal, body.model, prompt=body.prompt,
                                         max_tokens=body.default_max_tokens())
        params = body.sampling_params(prepared.max_tokens, want_logprobs=body.logprobs is not None)
        rid, created = f"cmpl-{prepared.request_id}", int(time.time())

        def base(choices, usage_dict=None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                   "choices": choices}
            if usage_dict is not None:
                out["usage"] = usage_dict
            return out

        def logprobs_of(ids, lps):
            if body.logprobs is None:
                return None
            return {"tokens": _token_texts(prepared, ids), "token_logprobs": list(lps), "top_logprobs": None,
                    "text_offset": []}

        if body.stream:
            first, stream = await _open(prepared, params)

            def chunk(msg):
                return base([{"index": 0, "text": msg.text, "finish_reason": None,
                              "logprobs": logprobs_of(msg.token_ids, msg.logprobs)}])

            def final_chunk(msg, usage_only=False):
                if usage_only:
                    return base([], _usage(msg, prepared))
                return base([{"index": 0, "text": "", "finish_reason": _reason(msg), "logprobs": None}])

            return _sse(prepared, first, stream, chunk, final_chunk, body.include_usage)
        result = await _collect(prepared, params)
        # A JSONResponse of plain JSON types: returning the dict would run it through FastAPI's
        # jsonable_encoder first, which rebuilds it for nothing (measurable at one token per request).
        return JSONResponse(base([{"index": 0, "text": "".join(result.text), "finish_reason": _reason(result.final),
                                   "logprobs": logprobs_of(result.token_ids, result.logprobs)}],
                                 _usage(result.final, prepared)))

    @app.post("/v1/chat/completions", responses=_STREAMABLE)
    async def chat_completions(body: ChatCompletionRequest, principal: Principal = Depends(tenant)):
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_value", "messages")
        prepared = ctx.inference.prepare(principal, body.model, messages=messages,
                                         max_tokens=body.default_max_tokens())
        params = body.sampling_params(prepared.max_tokens, want_logprobs=body.logprobs)
        rid, created = f"chatcmpl-{prepared.request_id}", int(time.time())

        def base(kind, choices, usage_dict=None) -> dict:
            out = {"id": rid, "object": kind, "created": created, "model": body.model, "choices": choices}
            if usage_dict is not None:
                out["usage"] = usage_dict
            return out

        def logprobs_of(ids, lps):
            if not body.logprobs:
                return None
            texts = _token_texts(prepared, ids)
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(texts, lps, strict=False)]}

        if body.stream:
            first, stream = await _open(prepared, params)
            sent_role = False

            def chunk(msg):
                nonlocal sent_role
                delta = {"content": msg.text}
                if not sent_role:
                    delta["role"] = "assistant"
                    sent_role = True
                return base("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": None,
                                                       "logprobs": logprobs_of(msg.token_ids, msg.logprobs)}])

            def final_chunk(msg, usage_only=False):
                if usage_only:
                    return base("chat.completion.chunk", [], _usage(msg, prepared))
                return base("chat.completion.chunk", [{"index": 0, "delta": {}, "finish_reason": _reason(msg)}])

            return _sse(prepared, first, stream, chunk, final_chunk, body.include_usage)
        result = await _collect(prepared, params)
        message = {"role": "assistant", "content": "".join(result.text)}
        return JSONResponse(base("chat.completion", [{"index": 0, "message": message,
                                                      "finish_reason": _reason(result.final),
                                                      "logprobs": logprobs_of(result.token_ids, result.logprobs)}],
                                 _usage(result.final, prepared)))

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
                                         monthly_token_quota=body.monthly_token_quota)
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
                                      tokens_per_minute=body.tokens_per_minute)
        return {"key": created.secret, **created.info.__dict__}

    @app.delete("/admin/v1/keys/{key_id}")
    def admin_revoke_key(key_id: str, principal: Principal = Depends(admin)):
        with ctx.sessions.begin() as session:
            info = auth.revoke_key(session, key_id, scope_of(principal), actor=principal.actor)
        ctx.keys.refresh()
        return info.__dict__

    @app.get("/admin/v1/models")
    def admin_list_models(principal: Principal = Depends(admin)):
        with ctx.sessions.begin() as session:
            return {"data": [m.__dict__ for m in registry.list_models(session, scope_of(principal))]}

    @app.post("/admin/v1/models", status_code=201)
    def admin_register_model(body: ModelIn, principal: Principal = Depends(admin)):
        with ctx.sessions.begin() as session:
            info = registry.register_model(session, body.source, actor=principal.actor, name=body.name,
                                           version=body.version, owner_tenant_id=principal.tenant_id,
                                           visibility=body.visibility, expected_sha256=body.sha256)
        return info.__dict__

    @app.delete("/admin/v1/models/{ref:path}")
    def admin_delete_model(ref: str, principal: Principal = Depends(admin)):
        with ctx.sessions.begin() as session:
            deleted = registry.delete_model(session, scope_of(principal), ref, actor=principal.actor)
        return {"deleted": [m.ref for m in deleted]}

    @app.get("/", include_in_schema=False)
    async def root():
        return PlainTextResponse("inferplane gateway: OpenAI-compatible API under /v1\n")

    return app


def _reason(msg: worker_pb2.GenerateResponse | None) -> str | None:
    if msg is None:
        return None
    return {"abort": "stop"}.get(msg.finish_reason, msg.finish_reason) or None

