"""Probes: what load balancers and Kubernetes ask, none of it in the OpenAPI schema.

No /metrics here: its series name tenants, keys and private adapters, and every tenant reaches
this port. The gateway serves them on its own metrics listener (metrics.metrics_asgi_app).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from inferplane.control_plane.gateway.routes.dependencies import Context

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
async def healthz():
    return {"status": "ok"}


@router.get("/readyz", include_in_schema=False)
async def readyz(ctx: Context):
    routing = ctx.inference.router
    healthy = [a for a in routing.addresses() if routing.health.is_healthy(a)]
    if not healthy:
        return JSONResponse({"status": "waiting for a healthy worker"}, status_code=503)
    return {"status": "ready", "workers": len(healthy)}
