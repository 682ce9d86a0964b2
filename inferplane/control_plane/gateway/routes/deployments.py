"""`/admin/v1/deployments`: InferenceDeployments added, changed and removed on a running
`inferplane up` (platform admins only: a deployment takes the machine's processors and memory).

The body is the resource `kubectl apply` takes in a cluster. In a cluster these routes answer 404:
there the resources are the one way in (gateway/deployment_control.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from inferplane.control_plane.errors import InvalidInput, NotFound
from inferplane.control_plane.gateway.deployment_control import DeploymentControl
from inferplane.control_plane.gateway.routes.dependencies import AdminCaller, Context, require_platform_admin

router = APIRouter()


def _control(ctx: Any, principal: Any) -> DeploymentControl:
    require_platform_admin(principal)
    if ctx.deployment_control is None:
        raise NotFound("this gateway does not run its deployments: in a cluster, `kubectl apply` an "
                       "InferenceDeployment (or `helm upgrade`)")
    return ctx.deployment_control


@router.get("/admin/v1/deployments", tags=["admin"])
def list_deployments(ctx: Context, principal: AdminCaller) -> dict[str, Any]:
    return {"object": "list", "data": _control(ctx, principal).list()}


@router.get("/admin/v1/deployments/{name}", tags=["admin"])
def get_deployment(name: str, ctx: Context, principal: AdminCaller) -> dict[str, Any]:
    return _control(ctx, principal).get(name)


@router.put("/admin/v1/deployments/{name}", tags=["admin"])
async def apply_deployment(name: str, ctx: Context, principal: AdminCaller,
                           manifest: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Creates or changes the deployment (201 is not used: `action` says which, as `kubectl apply`)."""
    control = _control(ctx, principal)
    metadata = manifest.get("metadata")
    if not isinstance(metadata, dict) or metadata.get("name") != name:
        raise InvalidInput(f"metadata.name must be the name in the path ({name!r})", param="metadata.name")
    return await control.apply(manifest)


@router.delete("/admin/v1/deployments/{name}", tags=["admin"])
async def delete_deployment(name: str, ctx: Context, principal: AdminCaller) -> dict[str, Any]:
    return await _control(ctx, principal).delete(name)
