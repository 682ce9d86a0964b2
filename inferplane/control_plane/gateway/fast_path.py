"""Serves the inference endpoints (completions, chat, embeddings) in front of FastAPI, as a plain ASGI app.

With one-token requests, FastAPI's per-request machinery (its telemetry and body-limit middlewares,
route matching, dependency solving, the exception-handling layers) cost more gateway CPU than
the request itself: about a quarter of the event loop's time under `inferplane bench gateway`,
against 7% for the endpoint's own work. This does what those layers did for these two paths,
in the same order and with the same answers, and nothing else:

  read the body (the limit is `LimitsAndMetrics`', in front of every route: over it, the client has
  its 413 and this sees a disconnect) →
  authenticate (401/403), so that no work is done on the body of an unknown caller → decode JSON
  when the content type says JSON (400 if it is not JSON, or nested too deeply) → validate the
  body with the same pydantic model (400) → `Completions` or `Embeddings`, cancelled if the client
  disconnects before it has a response (a non-streaming request would otherwise generate to the
  end for nobody, holding a worker's sequence and its KV blocks; streams stop on their own).

Every other request, including other methods on these paths, goes on to FastAPI. The FastAPI
routes for these paths stay: they document the endpoints in the OpenAPI schema, and they call the
same `Completions` and `Embeddings` methods, so the two cannot drift apart in what they send back.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from inferplane.control_plane.auth import Principal
from inferplane.control_plane.gateway.completions import Completions
from inferplane.control_plane.gateway.console.sessions import CSRF_HEADER, session_cookie
from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.embeddings import Embeddings
from inferplane.control_plane.gateway.errors import (
    as_error,
    error_response,
    param_of,
    validation_error_response,
)
from inferplane.control_plane.gateway.middleware import Scope, header
from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

Handler = Callable[[Any, Principal], Awaitable[Response]]


class _Disconnected(Exception):
    """The client went away before it finished sending the body, or the body crossed the limit (the
    client has its 413): nobody to answer."""


@dataclass(frozen=True)
class _Endpoint:
    body_model: type[BaseModel]
    handler: Handler
    route: Any  # the FastAPI route of the same path: metrics label requests by its path


class InferenceFastPath:
    def __init__(self, app, ctx: GatewayContext, routes_by_path: dict[str, Any]) -> None:
        self.app = app
        self.ctx = ctx
        completions = Completions(ctx)
        self.endpoints = {
            "/v1/completions": _Endpoint(CompletionRequest, completions.text, routes_by_path["/v1/completions"]),
            "/v1/chat/completions": _Endpoint(ChatCompletionRequest, completions.chat,
                                              routes_by_path["/v1/chat/completions"]),
            "/v1/embeddings": _Endpoint(EmbeddingRequest, Embeddings(ctx).create, routes_by_path["/v1/embeddings"]),
        }

    async def __call__(self, scope: Scope, receive, send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = endpoint.route
        try:
            response = await self._handle(endpoint, scope, receive)
        except _Disconnected:
            return
        except Exception as exc:  # everything the request path raises becomes an OpenAI error body
            status, message, code, headers = as_error(exc)
            response = error_response(status, message, code, param_of(exc), headers=headers)
        await response(scope, receive, send)

    async def _handle(self, endpoint: _Endpoint, scope: Scope, receive) -> Response:
        raw = await self._read_body(receive)
        principal = await self.ctx.authenticate(header(scope, b"authorization"),
                                                session_cookie(header(scope, b"cookie")),
                                                header(scope, CSRF_HEADER.encode()), admin=False)
        content_type = header(scope, b"content-type")
        if len(raw) > OFF_LOOP_BODY_BYTES:  # a big body's parse would hold the loop other tenants need
            parsed = await asyncio.to_thread(_parse, endpoint, raw, content_type)
        else:
            parsed = _parse(endpoint, raw, content_type)
        if isinstance(parsed, Response):
            return parsed
        return await _cancelled_on_disconnect(endpoint.handler(parsed, principal), receive)

    async def _read_body(self, receive) -> bytes:
        """The whole body; `receive` is bounded by `LimitsAndMetrics`, which answers 413 over the limit
        and then says the client went away."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


# Bodies larger than this are parsed and validated on a thread: a 1 MiB body (100,000 choices)
# takes tens of milliseconds of JSON and pydantic work, which on the event loop would delay every
# other request and /healthz; on a thread the loop keeps its turn every switch interval.
OFF_LOOP_BODY_BYTES = 64 << 10


def _parse(endpoint: _Endpoint, raw: bytes, content_type: str | None) -> Any:
    """The validated body model, or the error response for a body that is not one."""
    data: Any = raw
    if not raw:
        data = None
    elif _is_json(content_type):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            return error_response(400, "request body is not valid JSON", "invalid_json")
        except ValueError:  # not UTF-8 at all
            return error_response(400, "There was an error parsing the body", None)
    if data is None:
        return validation_error_response([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        # from_attributes: FastAPI validates bodies that way, and its error for a body that is not
        # an object ("...object to extract fields from") is the one clients have seen so far.
        return endpoint.body_model.model_validate(data, from_attributes=True)
    except ValidationError as exc:
        return validation_error_response(exc.errors())


async def _cancelled_on_disconnect(work: Awaitable[Response], receive) -> Response:
    """Await `work`, unless the client disconnects first: then cancel it (closing the worker stream
    frees the sequence) and raise _Disconnected. The body has been read, so the only message left
    to receive is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _Disconnected
    finally:
        for pending in (task, watcher):  # also when this coroutine itself is cancelled
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending


async def _disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule (strict content type): a body is JSON only when the request says so."""
    if not content_type:
        return False
    if content_type == "application/json":  # what nearly every client sends
        return True
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
