"""`POST /v1/messages`: Anthropic's Messages API, served as chat completions (anthropic_messages.py).

The `anthropic` client sends its key as `x-api-key` (`api_key=`) or as a bearer token
(`auth_token=`): both are the tenant's API key here. Every error, the key's included, has
Anthropic's shape, which is what that client reads. Not in the OpenAPI schema, whose error bodies
are OpenAI's: docs/anthropic-messages.md describes it.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferplane.control_plane.gateway import anthropic_messages as anthropic
from inferplane.control_plane.gateway.chat_stream import response_body
from inferplane.control_plane.gateway.completions import Completions
from inferplane.control_plane.gateway.errors import as_error
from inferplane.control_plane.gateway.routes.dependencies import Context, request_caller

router = APIRouter(include_in_schema=False)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(anthropic.error_body(status, message), status_code=status)


@router.post("/v1/messages")
async def create_message(request: Request, ctx: Context) -> Response:
    try:
        authorization = request.headers.get("authorization")
        if authorization is None and request.headers.get("x-api-key"):
            authorization = f"Bearer {request.headers['x-api-key']}"
        principal = await request_caller(ctx, request, authorization, admin=False)
        body = anthropic.parse_request(await request.body())
        chat = anthropic.to_chat(body)
        answer = await Completions(ctx).chat(chat, principal)
    except anthropic.InvalidMessages as exc:
        return _error(400, str(exc))
    except Exception as exc:  # as the OpenAI routes map it, in Anthropic's shape
        status, message, _, headers = as_error(exc)
        response = _error(status, message)
        response.headers.update(headers or {})
        return response
    if answer.status_code != 200:  # refused in Completions (bad messages, no such model...): its message kept
        detail = (response_body(answer)).decode()
        try:
            message = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = detail
        return _error(400 if answer.status_code == 422 else answer.status_code, message)
    if isinstance(answer, StreamingResponse):
        inner = answer.body_iterator

        async def events():
            try:
                async for event in anthropic.stream_events(inner, body.model):
                    yield event
            finally:
                await inner.aclose()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(anthropic.from_completion(json.loads(response_body(answer)), body.model))
