"""Endpoints from the EndpointSlices of a deployment's headless Service.

EndpointSlices rather than the legacy Endpoints object: that is what kube-proxy and service meshes
read, it carries per-endpoint ``ready``/``terminating`` conditions, and it scales past 1000 pods.
Parsing is a pure function over plain dicts or client model objects so it is testable without a
cluster; the source only adds the list call and a refresh loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from inferplane.control_plane.routing.endpoints import Endpoint

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _get(obj: Any, *names: str) -> Any:
    """Field of a slice given as an API dict (camelCase), a ``to_dict()`` dict (snake_case) or a
    ``kubernetes.client`` model object (snake_case attributes)."""
    for name in names:
        if isinstance(obj, Mapping):
            if name in obj:
                return obj[name]
        elif hasattr(obj, name):
            return getattr(obj, name)
    return None


def _format(address: str, port: int, address_type: str | None) -> str:
    if address_type == "IPv6" or (":" in address and not address.startswith("[")):
        return f"[{address}]:{port}"
    return f"{address}:{port}"


def endpoints_from_slices(slices: Iterable[Any], port_name: str | None = "grpc") -> tuple[Endpoint, ...]:
    """Ready, non-terminating endpoints of the given slices, deduplicated and sorted.

    ``port_name`` picks the slice port by name; when no port has that name (or it is ``None``) the
    first port is used, so a Service with one unnamed port works too. Per the API, a missing
    ``ready`` condition means "unknown" and consumers should treat it as ready.
    """
    found: dict[str, Endpoint] = {}
    for sl in slices:
        ports = _get(sl, "ports") or []
        port = None
        for p in ports:
            if port_name is not None and _get(p, "name") == port_name:
                port = _get(p, "port")
                break
        if port is None and ports:
            port = _get(ports[0], "port")
        if port is None:
            continue
        address_type = _get(sl, "addressType", "address_type")
        for ep in _get(sl, "endpoints") or []:
            cond = _get(ep, "conditions") or {}
            if _get(cond, "ready") is False or _get(cond, "terminating") is True:
                continue
            ref = _get(ep, "targetRef", "target_ref")
            name = (_get(ref, "name") if ref is not None else None) or ""
            for addr in _get(ep, "addresses") or []:
                ep_out = Endpoint(address=_format(addr, int(port), address_type), name=name)
                found.setdefault(ep_out.address, ep_out)
    return tuple(sorted(found.values(), key=lambda e: e.address))


class KubernetesEndpointSource:
    """Ready replicas of one headless Service, refreshed by listing its EndpointSlices.

    Listing on an interval (default 2 s) instead of a watch keeps this restart-free and simple; the
    health tracker covers the seconds in between (a pod that dies fails its first request before
    any token, and the retry policy moves that request).
    """

    def __init__(self, service: str, namespace: str, *, port_name: str | None = "grpc",
                 api: Any = None) -> None:
        self.service = service
        self.namespace = namespace
        self.port_name = port_name
        self._api = api
        self._snapshot: tuple[Endpoint, ...] = ()

    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._snapshot

    def _discovery_api(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def refresh(self) -> tuple[Endpoint, ...]:
        """One blocking list call; keeps the last good snapshot when the API call fails."""
        resp = self._discovery_api().list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}")
        items = resp["items"] if isinstance(resp, Mapping) else resp.items
        self._snapshot = endpoints_from_slices(items or [], self.port_name)
        return self._snapshot

    async def run(self, interval_s: float = 2.0) -> None:
        """Refresh forever (cancel the task to stop); the blocking client runs in a thread."""
        while True:
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:  # keep serving the last snapshot, retry next tick
                log.warning("listing EndpointSlices of %s/%s failed", self.namespace, self.service,
                            exc_info=True)
            await asyncio.sleep(interval_s)
