"""The gateway's side of prefill/decode disaggregation, without workers: a disaggregated resource's
route carries its prefill pool (its own Service, polled and dropped with it), the router picks in
that pool, counts a prompt's uncached tokens from the decode replica's own KV events only, and both
pools are autoscaled apart (the prefill pool's replicas are spec.disaggregation.prefill.replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

from inferplane.api.kv_blocks import Medium
from inferplane.control_plane.autoscale.activator import Activator
from inferplane.control_plane.autoscale.autoscaler import Autoscaler
from inferplane.control_plane.autoscale.kube import _is_prefill, _split, prefill_target
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.kube_sync import KubernetesCatalogSync
from inferplane.control_plane.gateway.served_routes import resource_route, resource_routes, router_deployment
from inferplane.control_plane.routing import Deployment, Endpoint, Router, RouteRequest, StaticEndpointSource
from inferplane.control_plane.routing.prefix import block_hashes
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from tests.control_plane.test_kube_sync import StaticPollingSource, idep

SPLIT = {"runtime": "cpu-int8", "disaggregation": {"enabled": True, "minPrefillTokens": 256,
                                                   "prefill": {"replicas": 2, "maxReplicas": 3}}}


def test_a_disaggregated_route_names_its_prefill_pool_and_threshold() -> None:
    route = resource_route(idep("chat", **SPLIT))
    assert (route.prefill_pool, route.prefill_deployment_name, route.min_prefill_tokens) == \
        ("chat-prefill", "team-a/chat-prefill", 256)
    assert route.routing_policy == "kv-aware"  # the tier disaggregation brings, and the radix events
    plain = resource_route(idep("chat", runtime="cpu-int8"))
    assert plain.prefill_pool is None and plain.prefill_deployment_name is None
    deployment = router_deployment(route, StaticEndpointSource(["10.0.0.1:50051"]),
                                   StaticEndpointSource(["10.0.0.2:50051"]))
    assert deployment.prefill is not None and deployment.prefill.name == "team-a/chat-prefill"
    assert router_deployment(plain, StaticEndpointSource()).prefill is None


def test_the_router_picks_in_the_prefill_pool_and_polls_its_health() -> None:
    prefill = Deployment("chat-prefill", StaticEndpointSource(["10.0.0.2:1", "10.0.0.3:1"]))
    decode = Deployment("chat", StaticEndpointSource(["10.0.0.1:1"]), prefill=prefill)
    router = Router({"chat": [decode]})
    assert router.addresses() == {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}
    request = RouteRequest("chat", token_ids=list(range(100)))
    assert router.pick(request).address == "10.0.0.1:1"  # a request's own pick never lands in the prefill pool
    lease = router.pick_prefill(decode, request)
    assert lease.address in {"10.0.0.2:1", "10.0.0.3:1"} and router.load.outstanding(lease.address) == 1
    lease.release(True)
    assert router.load.outstanding(lease.address) == 0
    assert [c[1] for c in router.replica_counts()] == ["chat", "chat-prefill"]


def test_uncached_tokens_count_only_what_the_decode_replica_reports_holding() -> None:
    decode = Deployment("chat", StaticEndpointSource(["10.0.0.1:1"]), routing_policy="kv-aware", block_size=16)
    router = Router({"chat": [decode]})
    tokens = list(range(100))
    request = RouteRequest("chat", token_ids=tokens, cache_salt="salt")
    assert router.uncached_tokens(decode, "10.0.0.1:1", request) == 100
    router.pick(request)  # kv-aware routing notes its pick provisionally: not a held block
    assert router.uncached_tokens(decode, "10.0.0.1:1", request) == 100
    hashes = block_hashes(tokens[:99], 16, "salt")
    router.kv_index.stored("10.0.0.1:1", Medium.MEMORY, hashes[:4])
    assert router.uncached_tokens(decode, "10.0.0.1:1", request) == 100 - 4 * 16
    other_tenant = RouteRequest("chat", token_ids=tokens, cache_salt="other")
    assert router.uncached_tokens(decode, "10.0.0.1:1", other_tenant) == 100
    blind = Deployment("chat", StaticEndpointSource(["10.0.0.1:1"]), routing_policy="prefix-hash")
    assert router.uncached_tokens(blind, "10.0.0.1:1", request) == 100  # no events followed: all of it


async def test_the_sync_polls_the_prefill_service_and_stops_with_it() -> None:
    router, sources = Router(), {}

    def factory(service: str, namespace: str) -> StaticPollingSource:
        sources[service] = StaticPollingSource([Endpoint(f"10.0.0.{len(sources) + 1}:50051")])
        return sources[service]

    resources: list[dict[str, Any]] = [idep("chat", **SPLIT)]
    sync = KubernetesCatalogSync(router, Catalog(), WorkerChannels(), lister=lambda: resources,
                                 source_factory=factory)
    StaticPollingSource.started = StaticPollingSource.cancelled = 0
    try:
        sync.apply(resource_routes(resources))
        await asyncio.sleep(0)
        assert sorted(sources) == ["chat", "chat-prefill"] and StaticPollingSource.started == 2
        (deployment,) = router.deployments("llama-8b")
        assert deployment.prefill is not None and deployment.prefill.source is sources["chat-prefill"]
        resources[0] = idep("chat", runtime="cpu-int8")  # disaggregation off: its poller stops
        sync.apply(resource_routes(resources))
        await asyncio.sleep(0)
        assert StaticPollingSource.cancelled == 1
        (deployment,) = router.deployments("llama-8b")
        assert deployment.prefill is None
    finally:
        await sync.stop()
    assert StaticPollingSource.cancelled == 2


async def test_both_pools_are_autoscaled_on_their_own() -> None:
    router = Router()
    autoscaler = Autoscaler(router, WorkerChannels(), Activator(), scaler=None)  # type: ignore[arg-type]
    elastic = idep("chat", replicas=1, minReplicas=0, maxReplicas=4, autoscaling={"enabled": True}, **SPLIT)
    sync = KubernetesCatalogSync(router, Catalog(), WorkerChannels(), lister=lambda: [],
                                 source_factory=lambda s, n: StaticPollingSource([Endpoint(f"{s}:1")]),
                                 autoscaler=autoscaler)
    try:
        sync.apply(resource_routes([elastic]))
        assert set(autoscaler.targets) == {"team-a/chat", "team-a/chat/prefill"}
        prefill = autoscaler.targets["team-a/chat/prefill"]
        assert (prefill.deployment, prefill.policy.min_replicas, prefill.policy.max_replicas) == \
            ("team-a/chat-prefill", 1, 3)
        # Each target reads its own pool's replicas.
        assert autoscaler._addresses(prefill) == ["chat-prefill:1"]
        assert autoscaler._addresses(autoscaler.targets["team-a/chat"]) == ["chat:1"]
        assert autoscaler.activator._policies["llama-8b"] is not None  # the decode pool may sit at zero
        sync.apply(resource_routes([idep("chat", runtime="cpu-int8")]))
        assert autoscaler.targets == {}
    finally:
        await sync.stop()


def test_the_prefill_pools_scaler_name_maps_to_its_resource() -> None:
    assert prefill_target("team-a/chat") == "team-a/chat/prefill"
    assert _split("team-a/chat/prefill") == ("team-a", "chat") and _is_prefill("team-a/chat/prefill")
    assert _split("team-a/chat") == ("team-a", "chat") and not _is_prefill("team-a/chat")
