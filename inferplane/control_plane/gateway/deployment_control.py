"""What the admin API's `/admin/v1/deployments` needs from whatever runs the workers.

Under `inferplane up` the local platform runs them (local/deployment_control.py implements this);
in a cluster the operator does, from InferenceDeployment resources, and the gateway has no such
control (`GatewayContext.deployment_control` is None): there the routes answer 404 pointing at
`kubectl apply`, since a second way in would let the API and the resources disagree.
"""

from __future__ import annotations

from typing import Any, Protocol


class DeploymentControl(Protocol):
    def list(self) -> list[dict[str, Any]]:
        """Every deployment: its manifest (apiVersion, kind, metadata, spec) and a `status`."""

    def get(self, name: str) -> dict[str, Any]:
        """One deployment as `list` shows it; NotFound naming it."""

    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Creates or changes the deployment the manifest names (the same body `kubectl apply` takes),
        rolling its replicas over with no request failed; returns it as `get` does with the `action`
        taken: "created", "configured" or "unchanged". InvalidInput naming the field for a bad spec."""

    async def delete(self, name: str) -> dict[str, Any]:
        """Removes the deployment: its model leaves the routes at once, its replicas finish what they
        have in flight, then stop. NotFound naming it."""
