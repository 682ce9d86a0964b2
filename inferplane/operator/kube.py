"""A small async Kubernetes REST client for the operator's own reads and writes.

kopf talks to the API for its own needs but offers no client for handlers. This one reuses the
credentials kopf's login produced (`kopf.ConnectionInfo`), so both sides authenticate the same
way, and it is async, so handlers never block kopf's event loop: reconciling hundreds of
resources at once costs one event loop, not a thread each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp

FIELD_MANAGER = "inferplane-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML; the API server accepts it
MERGE_CONTENT_TYPE = "application/merge-patch+json"

# kind → plural for everything the operator writes (no discovery round-trips needed).
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "PrometheusRule": "prometheusrules",
    "InferenceDeployment": "inferencedeployments",
}


class ApiError(Exception):
    """A non-2xx answer; `retryable` tells transient failures (throttling, conflicts, 5xx) from bad requests."""

    def __init__(self, status: int, reason: str, message: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.status in (409, 429) or self.status >= 500


def path_for(api_version: str, plural: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def path_of(obj: Mapping[str, Any], *, named: bool = True, subresource: str | None = None) -> str:
    meta = obj["metadata"]
    return path_for(obj["apiVersion"], PLURALS[obj["kind"]], meta.get("namespace"),
                    meta["name"] if named else None, subresource)


class KubeClient:
    """Requests against one API server with one set of credentials."""

    def __init__(self, server: str, session: aiohttp.ClientSession) -> None:
        self.server = server.rstrip("/")
        self.session = session

    @classmethod
    def from_connection_info(cls, info: Any) -> KubeClient:
        """Build from a kopf.ConnectionInfo, as kopf builds its own session from it."""
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": "inferplane-operator"},
            timeout=aiohttp.ClientTimeout(total=30),
        )
        return cls(info.server, session)

    async def close(self) -> None:
        await self.session.close()

    async def request(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
                      params: Mapping[str, str] | None = None) -> dict[str, Any] | None:
        """One API call; None for 404 on reads and deletes, ApiError for any other failure."""
        data = None if body is None else json.dumps(body)
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        try:
            async with self.session.request(method, self.server + path, data=data, headers=headers,
                                            params=params) as response:
                text = await response.text()
                if response.status == 404 and method in ("GET", "DELETE"):
                    return None
                if response.status >= 400:
                    try:
                        payload = json.loads(text)
                    except ValueError:
                        payload = {}
                    raise ApiError(response.status, str(payload.get("reason") or response.reason),
                                   str(payload.get("message") or text[:500]), method, path)
                return json.loads(text) if text else {}
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(503, type(exc).__name__, str(exc), method, path) from exc

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self.request("GET", path)

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Server-side apply: creates or updates, and drops the fields this manager stopped setting.

        Strict field validation: a field the server does not know is an error (400) here, where
        the default would prune it with only a warning header that nobody reads.
        """
        return await self.request("PATCH", path_of(obj), body=obj, content_type=APPLY_CONTENT_TYPE,
                                  params={"fieldManager": FIELD_MANAGER, "force": "true",
                                          "fieldValidation": "Strict"})

    async def patch_status(self, obj_path: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        return await self.request("PATCH", obj_path + "/status", body={"status": status},
                                  content_type=MERGE_CONTENT_TYPE)

    async def delete(self, path: str, *, propagation: str = "Background") -> dict[str, Any] | None:
        return await self.request("DELETE", path, body={"kind": "DeleteOptions", "apiVersion": "v1",
                                                        "propagationPolicy": propagation})
