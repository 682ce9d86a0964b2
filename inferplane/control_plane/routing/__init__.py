"""Replica routing for the gateway: served model -> deployment -> replica, with retry and health.

Typical wiring (see each module for the why):

    router = Router({"llama": [Deployment("llama-a", source_a, weight=0.9),
                               Deployment("llama-cpu", source_cpu, tier=Tier.SPILLOVER)]})
    poller = HealthPoller(router.health, router.addresses)      # asyncio.create_task(poller.run())
    req = RouteRequest("llama", token_ids=ids, cache_salt=tenant_cache_salt(tenant, secret))
    async for msg in route_and_stream(router, req, lambda ep: stub(ep).Generate(greq)):
        ...
"""

from inferplane.control_plane.routing.endpoints import Endpoint, EndpointSource, StaticEndpointSource
from inferplane.control_plane.routing.errors import (
    NoReplicaAvailable,
    RoutingError,
    StreamBrokenAfterStart,
    UnknownModel,
)
from inferplane.control_plane.routing.health import HealthPoller, HealthTracker
from inferplane.control_plane.routing.kube import KubernetesEndpointSource, endpoints_from_slices
from inferplane.control_plane.routing.load import LoadTracker
from inferplane.control_plane.routing.prefix import block_hashes, prefix_key
from inferplane.control_plane.routing.retry import is_retryable, route_and_stream
from inferplane.control_plane.routing.ring import HashRing, bounded_pick, load_bound
from inferplane.control_plane.routing.router import Deployment, Lease, Router, RouteRequest, Tier
from inferplane.control_plane.routing.salt import tenant_cache_salt

__all__ = [
    "Deployment", "Endpoint", "EndpointSource", "HashRing", "HealthPoller", "HealthTracker",
    "KubernetesEndpointSource", "Lease", "LoadTracker", "NoReplicaAvailable", "RouteRequest", "Router",
    "RoutingError", "StaticEndpointSource", "StreamBrokenAfterStart", "Tier", "UnknownModel",
    "block_hashes", "bounded_pick", "endpoints_from_slices", "is_retryable", "load_bound", "prefix_key",
    "route_and_stream", "tenant_cache_salt",
]
