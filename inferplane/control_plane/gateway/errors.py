"""Every failure becomes OpenAI's error body with the right status, never a bare 500.

`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}` is what the official
client parses into its exception types (AuthenticationError, NotFoundError, RateLimitError...).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from inferplane.control_plane.errors import ControlPlaneError
from inferplane.control_plane.routing import NoReplicaAvailable, RoutingError, StreamBrokenAfterStart, UnknownModel

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body of every error response; documented in the OpenAPI schema for 4XX and 5XX so that
    clients generated from it (and schemathesis) expect what the gateway really sends, not
    FastAPI's default `{"detail": [...]}` validation error."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict] = {
    "4XX": {"model": ErrorBody, "description": "OpenAI-style error (invalid request, key, model, limits)"},
    "5XX": {"model": ErrorBody, "description": "OpenAI-style error (no replica available, replica failed)"},
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def param_of(exc: BaseException) -> str | None:
    """The request parameter an error names (a worker's INVALID_ARGUMENT says it first), if any."""
    return exc.param if isinstance(exc, ControlPlaneError) else None


def as_error(exc: BaseException) -> tuple[int, str, str | None, dict[str, str] | None]:
    """Maps any exception the request path can raise to (status, message, code, headers)."""
    if isinstance(exc, ControlPlaneError):
        retry = exc.retry_after_header
        return exc.status, str(exc), exc.code, None if retry is None else {"Retry-After": retry}
    if isinstance(exc, UnknownModel):
        return 404, str(exc), "model_not_found", None
    if isinstance(exc, NoReplicaAvailable):
        return 503, str(exc), "no_replica_available", {"Retry-After": "1"}
    if _database_unavailable(exc):
        log.warning("database refused or unreachable: %s", " ".join(str(exc).split())[:300])
        return 503, "the database cannot take this request now (read-only or unreachable); retry later", \
            "database_unavailable", {"Retry-After": "5"}
    if isinstance(exc, RecursionError):  # json.loads on a body nested thousands deep
        return 400, "request body is nested too deeply", "invalid_json", None
    if isinstance(exc, StreamBrokenAfterStart):  # a replica died mid-answer: its fault, not a gateway bug
        return 503, f"the model replica failed mid-response; the output is incomplete ({exc})", "upstream_error", None
    log.exception("unexpected error on the request path", exc_info=exc)
    return 500, "internal error", "internal_error", None


def _database_unavailable(exc: BaseException) -> bool:
    """The database side, not our code: an operational failure (connection lost, SQLite read-only),
    or PostgreSQL refusing a write in a read-only transaction (a standby: SQLSTATE 25006)."""
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) == "25006"


def validation_error_response(errors: Sequence[Any], *, status: int = 400) -> JSONResponse:
    """pydantic's (or FastAPI's) validation errors → 400 for a body that is not JSON, else `status`
    (400 on the OpenAI API, as OpenAI answers and its clients expect; 422 on the admin API) naming
    the first offending field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "request body is not valid JSON", "invalid_json")
    message, param = validation_message(errors)
    code = "unsupported_parameter" if errors and errors[0].get("type") == "unserved" else "invalid_value"
    return error_response(status, message, code, param)


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message naming the first offending field, its dotted path) from pydantic's errors."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or (first.get("ctx") or {}).get("param")
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error_response(exc.errors(), status=400 if request.url.path.startswith("/v1/") else 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the first route's methods; a path may have several
            headers["Allow"] = _allowed_methods(request)
        return error_response(exc.status_code, str(exc.detail), None, headers=headers or None)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        # A route reading the body itself (`request.body()`) when the client went away, or when
        # LimitsAndMetrics cut the body off at the limit (the client has its 413 and this is dropped).
        return error_response(400, "the client disconnected before sending the whole body", None)

    async def _known(request: Request, exc: Exception):
        status, message, code, headers = as_error(exc)
        return error_response(status, message, code, param_of(exc), headers=headers)

    # Expected failures get their own handlers: Starlette re-raises (and logs as a crash) whatever
    # reaches the catch-all Exception handler, which is kept for real bugs only.
    for kind in (ControlPlaneError, RoutingError):
        app.add_exception_handler(kind, _known)
    app.add_exception_handler(Exception, _known)


def _allowed_methods(request: Request) -> str:
    """Every method some route of this path takes (the Allow header of a 405)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in _routes(request.app.router.routes):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _routes(routes: Sequence[Any]) -> Iterator[Any]:
    """`routes` with the routes of the routers included among them in their place: recent FastAPI
    keeps an included router as one entry (its `original_router`), which names no methods of its
    own; older FastAPI copied the router's routes into the app. (The gateway includes its routers
    without a prefix, so their routes match the request's whole path.)"""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is None:
            yield route
        else:
            yield from _routes(included.routes)


def sse_error(exc: BaseException) -> str:
    """The error event a stream ends with when it breaks after it started."""
    status, message, code, _ = as_error(exc)
    return f"data: {json.dumps(error_body(status, message, code, param_of(exc)))}\n\n"
