"""The REST gateway: builds the FastAPI app from the routers in `routes/` (metrics: metrics.py).

Paths and bodies follow OpenAI's so the official `openai` client works unchanged against
`http://host:port/v1`. Database work (admin API, usage) runs in FastAPI's thread pool; the
inference path never touches the database.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline

from inferplane.control_plane.gateway.context import GatewayContext
from inferplane.control_plane.gateway.errors import ERROR_RESPONSES, install_error_handlers
from inferplane.control_plane.gateway.fast_path import InferenceFastPath
from inferplane.control_plane.gateway.middleware import LimitsAndMetrics
from inferplane.control_plane.gateway.routes import (
    alerts,
    console,
    deployments,
    inference,
    keys,
    messages,
    registry,
    responses,
    service,
    tenants,
    usage,
)

# In this order: it is the order of the paths in the OpenAPI schema, and of matching. No route of
# one router shadows another's (`/v1/models/{model_id:path}` matches nothing outside /v1/models/,
# and `registry` keeps `GET /admin/v1/models/resolve` apart from `DELETE /admin/v1/models/{ref}`).
_ROUTERS = (alerts.router, service.router, inference.router, usage.router, tenants.router, keys.router,
            registry.router, messages.router, responses.router, deployments.router, console.router)


def create_asgi_app(ctx: GatewayContext):
    """What uvicorn serves: body-size limit and metrics around the inference fast path around the
    FastAPI app (which serves and documents everything else)."""
    api = create_app(ctx)
    # The fast path labels its requests' metrics with the FastAPI routes it stands in for.
    routes = {route.path: route for route in inference.router.routes if isinstance(route, APIRoute)}
    return LimitsAndMetrics(InferenceFastPath(api, ctx, routes), metrics=ctx.metrics, max_body_bytes=ctx.max_body_bytes)


def create_app(ctx: GatewayContext) -> FastAPI:
    """The FastAPI app serving `ctx`: its routes reach the context through `app.state.gateway`
    (routes/dependencies.py)."""
    # FastAPIOffline: /docs and /redoc with their scripts served from the package (FastAPI's own
    # pages load them from a CDN, and are blank offline).
    app: FastAPI = FastAPIOffline(title="inferplane gateway", version="0.1.0", responses=ERROR_RESPONSES,
                  description="OpenAI-compatible inference API with tenants, keys, quotas and routing.")
    app.state.gateway = ctx
    install_error_handlers(app)
    for router in _ROUTERS:
        app.include_router(router)
    return app
