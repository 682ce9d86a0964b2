"""The console's routes: its page and assets, sign-in and sign-out, and the one view the other APIs
lack (deployments and component health for operators).

Everything else the page shows comes from the APIs the CLI and clients already use (`/v1/models`,
`/v1/chat/completions`, `/v1/usage`, `/v1/alerts`, `/admin/v1/...`), called with the session
cookie and its CSRF header (console/sessions.py): one implementation of each rule, and the console can do
exactly what its credential can.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from urllib.parse import urlsplit

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import Field

from inferplane.api import metric_names
from inferplane.control_plane.errors import Forbidden, ServiceUnavailable, Unauthenticated
from inferplane.control_plane.gateway.admin_types import AdminBody
from inferplane.control_plane.gateway.console.sessions import COOKIE_NAME, CSRF_HEADER, ConsoleSessions
from inferplane.control_plane.gateway.routes.dependencies import AdminCaller, Context, require_platform_admin
from inferplane.v1 import worker_pb2

router = APIRouter(include_in_schema=False)
STATIC = resources.files("inferplane.control_plane.gateway.console") / "static"
MAX_CREDENTIAL_LENGTH = 4096  # an admin JWT with its claims fits many times over


class SignIn(AdminBody):
    key: str = Field(min_length=1, max_length=MAX_CREDENTIAL_LENGTH,
                     description="an API key (ip_...), the admin key, or an admin token")


def _sessions(ctx) -> ConsoleSessions:
    if ctx.console is None:
        raise ServiceUnavailable("the console is off on this gateway")
    return ctx.console


def _same_origin(request: Request) -> None:
    """Sign-in and sign-out are refused from another origin (a login CSRF would sign the victim into
    the attacker's tenant): browsers send Origin on every cross-origin POST and DELETE."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    host = request.headers.get("host", "")
    if origin == "null" or urlsplit(origin).netloc != host:
        raise Forbidden("Origin: the console accepts sign-ins from its own pages only")


def _secure(request: Request) -> bool:
    """Whether the browser reached us over HTTPS (directly or through a proxy that says so)."""
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").startswith("https")


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=307)


@router.get("/console")
async def console_redirect() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=307)


@router.get("/console/")
async def console_page() -> FileResponse:
    return FileResponse(str(STATIC / "index.html"), headers=_PAGE_HEADERS)


@router.get("/console/static/{path:path}")
async def console_asset(path: str) -> Response:
    asset = STATIC.joinpath(*[part for part in path.split("/") if part not in ("", ".", "..")])
    if not path or not asset.is_file():
        return JSONResponse({"error": {"message": f"no console asset {path!r}"}}, status_code=404)
    return FileResponse(str(asset), headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


# The page runs only its own scripts and reaches only this origin: an injected script or a
# framing page gets nothing.
_PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@router.post("/console/api/session")
async def sign_in(body: SignIn, request: Request, ctx: Context) -> JSONResponse:
    _same_origin(request)
    token, info = _sessions(ctx).sign_in(body.key)
    response = JSONResponse(info.__dict__)
    response.set_cookie(COOKIE_NAME, token, max_age=max(1, info.expires_at - int(time.time())), path="/",
                        httponly=True, samesite="strict", secure=_secure(request))
    return response


@router.get("/console/api/session")
async def session_info(request: Request, ctx: Context) -> JSONResponse:
    """The page's own session (role, tenant, scopes, CSRF token); 401 when it has none. Readable by
    this origin's script only: no CORS header lets another site read it."""
    token = request.cookies.get(COOKIE_NAME)
    if not token:
        raise Unauthenticated("not signed in")
    _, info = _sessions(ctx).principal(token, None)
    return JSONResponse(info.__dict__, headers={"Cache-Control": "no-store"})


@router.delete("/console/api/session")
async def sign_out(request: Request, ctx: Context) -> JSONResponse:
    _same_origin(request)
    token = request.cookies.get(COOKIE_NAME)
    sessions = _sessions(ctx)
    if token:
        sessions.principal(token, request.headers.get(CSRF_HEADER) or "")
        sessions.sign_out(token)
    response = JSONResponse({"signed_out": True})
    response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="strict", secure=_secure(request))
    return response


@router.get("/console/api/deployments")
async def deployments(ctx: Context, principal: AdminCaller) -> dict:
    """Every deployment the gateway routes to: replicas ready and desired, the autoscaler's last
    decision (its gauges in the gateway's registry), and per replica its health, requests in flight
    from here, and what its worker reports (runtime, running, queue, KV blocks used of total; asked
    all at once, each within STATS_TIMEOUT_S, so a stuck replica shows as unknown, not a slow page)."""
    require_platform_admin(principal)
    router_ = ctx.inference.router
    served = {m.name: m for m in ctx.catalog.visible(None)}
    listed = []
    for model, name, ready, desired in router_.replica_counts():
        deployment = next((d for d in router_.deployments(model) if d.name == name), None)
        addresses = [e.address for e in deployment.source.endpoints()] if deployment is not None else []
        listed.append((model, name, ready, desired, deployment, addresses))
    everyone = sorted({a for *_, addresses in listed for a in addresses})
    reports = dict(zip(everyone, await asyncio.gather(*(_worker_stats(ctx, a) for a in everyone)), strict=True))
    conditions = ctx.deployment_conditions() if ctx.deployment_conditions is not None else {}
    rows = []
    for model, name, ready, desired, deployment, addresses in listed:
        replicas = [{"address": a, "healthy": router_.health.is_healthy(a), "in_flight": router_.load.outstanding(a),
                     **reports[a]} for a in addresses]
        card = served.get(model)
        rows.append({"model": model, "deployment": name, "ready": ready, "desired": desired,
                     "runtime": next((r["runtime"] for r in replicas if r.get("runtime")), None),
                     "kind": card.kind if card else None, "max_model_len": card.max_model_len if card else None,
                     "owner_tenant": card.owner_tenant if card else None,
                     "routing_policy": deployment.routing_policy if deployment is not None else None,
                     "autoscaler": _autoscaler_decision(ctx, name), "replicas": replicas,
                     "conditions": [{k: c.get(k) for k in ("type", "status", "reason", "message")}
                                    for c in conditions[name]] if name in conditions else None})
    return {"object": "list", "data": rows}


STATS_TIMEOUT_S = 1.0
_AUTOSCALER_GAUGES = {"desired": metric_names.AUTOSCALER_DESIRED, "current": metric_names.AUTOSCALER_CURRENT,
                      "max": metric_names.AUTOSCALER_MAX, "saturation": metric_names.AUTOSCALER_SATURATION,
                      "panic": metric_names.AUTOSCALER_PANIC}


async def _worker_stats(ctx, address: str) -> dict:
    try:
        stats = await ctx.inference.channels.stub(address).Stats(worker_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S)
    except (TimeoutError, grpc.aio.AioRpcError):
        return {"runtime": None, "running": None, "waiting": None, "kv_blocks_used": None, "kv_blocks_total": None}
    v = stats.values
    number = lambda key: int(v[key]) if key in v else None  # noqa: E731 - one line per figure below
    return {"runtime": stats.runtime or None, "running": number("num_running"), "waiting": number("num_waiting"),
            "kv_blocks_used": number("blocks_used"), "kv_blocks_total": number("blocks_total")}


def _autoscaler_decision(ctx, deployment: str) -> dict | None:
    """The autoscaler's last decision for `deployment`, where this gateway runs it (None: it does not)."""
    registry = ctx.metrics.registry
    values = {key: registry.get_sample_value(name, {"deployment": deployment})
              for key, name in _AUTOSCALER_GAUGES.items()}
    if values["desired"] is None:
        return None
    return {"desired": int(values["desired"]), "current": int(values["current"] or 0),
            "max": int(values["max"] or 0), "saturation": values["saturation"], "panic": bool(values["panic"])}


@router.get("/console/api/health")
async def health(ctx: Context, principal: AdminCaller) -> dict:
    """Each component the gateway depends on, as it sees it now."""
    require_platform_admin(principal)
    router_ = ctx.inference.router
    addresses = sorted(router_.addresses())
    healthy = [a for a in addresses if router_.health.is_healthy(a)]
    usage = ctx.inference.usage
    last_flush = getattr(usage, "last_flush", None)
    return {"components": [
        {"component": "gateway", "ok": True, "detail": "serving this page"},
        {"component": "database", "ok": ctx.keys.database_ok,
         "detail": "key cache refreshes succeed" if ctx.keys.database_ok else "the latest key refresh failed"},
        {"component": "workers", "ok": bool(addresses) and len(healthy) == len(addresses),
         "detail": f"{len(healthy)} of {len(addresses)} replicas healthy"},
        {"component": "usage recorder", "ok": last_flush is None or time.time() - last_flush < 60,
         "detail": "never flushed yet" if not last_flush else f"last flushed {time.time() - last_flush:.0f} s ago"},
        {"component": "alert routing", "ok": ctx.alert_webhook_secret is not None,
         "detail": "webhook configured" if ctx.alert_webhook_secret else "off (no webhook secret)"},
    ]}
