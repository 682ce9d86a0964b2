"""`/v1/responses`: OpenAI's Responses API, served as chat completions (responses_request.py,
responses_output.py), with answers stored per tenant (stored_responses.py).

`POST` translates the request (continuing a stored conversation with `previous_response_id`), runs
it through `Completions.chat` (the chat route's keys, limits, flow control, routing and usage) and
answers a Response, or its events; with `store` (the default) the answer is stored before its last
event is sent, so a `GET` right after finds it. `GET /v1/responses/{id}` returns a stored answer and
`DELETE` deletes it; another tenant's id is a 404 exactly as an unknown one is. Errors have OpenAI's
shape, naming the Responses field. The database is reached in the thread pool, as the admin routes
reach it. Not in the OpenAPI schema (the body is read and checked here, not by FastAPI):
docs/responses.md describes it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from inferplane.control_plane import stored_responses
from inferplane.control_plane.auth import SCOPE_INFER, Principal
from inferplane.control_plane.errors import Forbidden
from inferplane.control_plane.gateway import responses_output, responses_request
from inferplane.control_plane.gateway.chat_stream import response_body
from inferplane.control_plane.gateway.completions import Completions
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.errors import as_error, error_response, param_of
from inferplane.control_plane.gateway.routes.dependencies import Context, TenantCaller

router = APIRouter(include_in_schema=False)


def _tenant(principal: Principal) -> str:
    principal.require(SCOPE_INFER)
    if principal.tenant_id is None:
        raise Forbidden("responses are stored per tenant; use a tenant's key")
    return principal.tenant_id


def _not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return error_response(404, f"Response with id {response_id!r} not found.", "not_found", param)


def _chat_error(status: int, message: str, code: str | None, param: str | None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    """An error of the chat path, naming the Responses request's field."""
    return error_response(status, responses_request.responses_message(message, param), code,
                          responses_request.responses_param(param), headers)


async def _save(ctx: GatewayContext, tenant: str, answer: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
    def save() -> None:
        with ctx.sessions.begin() as session:
            stored_responses.save(session, tenant, answer, conversation)

    await run_in_threadpool(save)


@router.post("/v1/responses")
async def create_response(request: Request, ctx: Context, principal: TenantCaller) -> Response:
    tenant = _tenant(principal)
    try:
        body = responses_request.parse_request(await request.body())
        earlier: list[dict[str, Any]] = []  # the previous response's input and output items
        if body.previous_response_id is not None:
            previous = await run_in_threadpool(_load, ctx, tenant, body.previous_response_id)
            if previous is None:
                return _not_found(body.previous_response_id, "previous_response_id")
            earlier = [*previous.conversation, *previous.response.get("output", [])]
        items = responses_request.input_items(body)
        conversation = [*earlier, *items]
        if body.stored and stored_responses.conversation_bytes(conversation) > stored_responses.MAX_CONVERSATION_BYTES:
            param = "previous_response_id" if earlier else "input"
            return error_response(400, f"{param}: the conversation would be more than "
                                       f"{stored_responses.MAX_CONVERSATION_BYTES} bytes of JSON, more than a stored "
                                       "response keeps; start a new conversation, or send it with store: false",
                                  "conversation_too_large", param)
        chat = responses_request.to_chat(body, earlier, items)
    except responses_request.InvalidRequest as exc:
        return error_response(400, str(exc), exc.code, exc.param)
    base = responses_output.skeleton(body, responses_output.new_id("resp"), int(time.time()))
    try:
        answer = await Completions(ctx).chat(chat, principal)
    except Exception as exc:  # as the app's handlers map it, naming the Responses field
        status, message, code, headers = as_error(exc)
        return _chat_error(status, message, code, param_of(exc), headers)
    if answer.status_code != 200:  # refused in Completions (bad messages...): OpenAI's body, renamed
        raw = response_body(answer)
        try:
            error = json.loads(raw)["error"]
            return _chat_error(answer.status_code, error["message"], error.get("code"), error.get("param"))
        except (ValueError, KeyError, TypeError):
            return answer
    if isinstance(answer, StreamingResponse):
        return StreamingResponse(_stream(ctx, tenant, body, base, conversation, answer.body_iterator),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    whole = responses_output.from_completion(json.loads(response_body(answer)), base)
    if body.stored:
        await _save(ctx, tenant, whole, conversation)
    return JSONResponse(whole)


async def _stream(ctx: GatewayContext, tenant: str, body: responses_request.ResponsesRequest, base: dict[str, Any],
                  conversation: list[dict[str, Any]], chunks: Any) -> AsyncIterator[str]:
    """The events; the finished answer is stored before its last event goes out (a failure to
    store it is the stream's error event instead)."""
    events = responses_output.ResponseEvents(base)
    unsaved = body.stored
    try:
        async for event in events.events(chunks):
            if events.final is not None and unsaved:
                try:
                    await _save(ctx, tenant, events.final, conversation)
                except Exception as exc:  # the database refused: say so rather than answer unstored
                    _, message, code, _ = as_error(exc)
                    for failure in events.failure(code, f"the response could not be stored: {message}", "store"):
                        yield failure
                    return
                unsaved = False
            yield event
    except Exception as exc:  # broken after the headers went out: the error events, as the chat stream's
        _, message, code, _ = as_error(exc)
        for failure in events.failure(code, message, param_of(exc)):
            yield failure
    finally:
        await chunks.aclose()


def _load(ctx: GatewayContext, tenant: str, response_id: str) -> stored_responses.ResponseRecord | None:
    with ctx.sessions.begin() as session:
        return stored_responses.get(session, tenant, response_id)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, ctx: Context, principal: TenantCaller) -> Response:
    tenant = _tenant(principal)
    query = request.query_params
    if query.get("stream", "false").lower() not in ("false", "0"):
        return error_response(400, "stream: replaying a stored response's events is not supported; retrieve it "
                                   "whole", "unsupported_parameter", "stream")
    if query.getlist("include") or query.getlist("include[]"):
        return error_response(400, "include: not supported by this server", "unsupported_parameter", "include")
    found = await run_in_threadpool(_load, ctx, tenant, response_id)
    if found is None:
        return _not_found(response_id)
    return JSONResponse(found.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, ctx: Context, principal: TenantCaller) -> Response:
    tenant = _tenant(principal)

    def remove() -> bool:
        with ctx.sessions.begin() as session:
            return stored_responses.remove(session, tenant, response_id)

    if not await run_in_threadpool(remove):
        return _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
