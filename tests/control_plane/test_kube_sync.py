"""The pure half of the cluster sync: InferenceDeployment objects -> routes -> the router's table.

No Kubernetes API and no worker here: resources are plain dicts as the API returns them, and the
endpoint sources are static lists (what the sync would get from EndpointSlices).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inferplane.api.resolve import served_cache_isolation
from inferplane.control_plane.gateway.catalog import Catalog
from inferplane.control_plane.gateway.kube_sync import KubernetesCatalogSync
from inferplane.control_plane.gateway.served_routes import resource_route, resource_routes, route_table
from inferplane.control_plane.routing import Endpoint, Router, RouteRequest, StaticEndpointSource, Tier
from inferplane.control_plane.routing.worker_channels import WorkerChannels


def idep(name: str, namespace: str = "team-a", *, deleting: bool = False, **spec: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": meta,
            "spec": {"model": {"name": "llama-8b"}, **spec}}


def test_served_name_defaults_to_the_model_name_then_the_resource_name() -> None:
    assert resource_route(idep("a")).served_model_name == "llama-8b"
    assert resource_route(idep("a", serving={"servedModelName": "chat"})).served_model_name == "chat"
    uri = idep("weights-b")
    uri["spec"]["model"] = {"uri": "pvc://weights/llama", "format": "safetensors"}
    assert resource_route(uri).served_model_name == "weights-b"


def test_ab_weights_and_spillover_tier_group_under_one_served_name() -> None:
    routes = resource_routes([
        idep("llama-a", serving={"servedModelName": "llama", "weight": 90}, engine={"blockSize": 32}),
        idep("llama-b", serving={"servedModelName": "llama", "weight": 10}),
        idep("llama-cpu", runtime="cpu-int8", serving={"servedModelName": "llama", "tier": "spillover"}),
        idep("other", serving={"servedModelName": "qwen"}),
    ])
    table = route_table(routes)
    assert list(table) == ["llama", "qwen"]
    by_name = {r.name: r for r in table["llama"]}
    assert [r.name for r in table["llama"]] == ["llama-a", "llama-b", "llama-cpu"]
    assert (by_name["llama-a"].weight, by_name["llama-b"].weight) == (90.0, 10.0)
    assert by_name["llama-a"].block_size == 32 and by_name["llama-b"].block_size == 16
    assert by_name["llama-cpu"].tier is Tier.SPILLOVER and by_name["llama-a"].tier is Tier.PRIMARY
    assert [r.name for r in table["qwen"]] == ["other"]


def test_the_same_name_in_two_namespaces_gives_two_deployments() -> None:
    table = route_table(resource_routes([idep("chat", "team-a"), idep("chat", "team-b")]))
    assert [r.deployment_name for r in table["llama-8b"]] == ["team-a/chat", "team-b/chat"]


def test_deleting_and_invalid_resources_take_no_traffic() -> None:
    bad = idep("broken", replicas=5, maxReplicas=2)  # replicas outside min..max: the spec does not parse
    routes = resource_routes([idep("gone", deleting=True), bad, idep("ok")])
    assert [r.name for r in routes] == ["ok"]


def test_model_fingerprint_follows_the_model_not_the_scale() -> None:
    base = resource_route(idep("a", replicas=1, maxReplicas=4))
    assert resource_route(idep("a", replicas=3, maxReplicas=4)).model_fingerprint == base.model_fingerprint
    other = idep("a", replicas=1, maxReplicas=4)
    other["spec"]["model"] = {"name": "llama-8b", "version": "2"}
    assert resource_route(other).model_fingerprint != base.model_fingerprint
    assert resource_route(idep("a", cacheIsolation="shared")).model_fingerprint != base.model_fingerprint


def test_cache_isolation_is_shared_only_when_every_deployment_says_so() -> None:
    shared = resource_route(idep("a", cacheIsolation="shared"))
    tenant = resource_route(idep("b"))
    assert served_cache_isolation(m.cache_isolation for m in [shared]) == "shared"
    assert served_cache_isolation(m.cache_isolation for m in [shared, tenant]) == "tenant"


class StaticPollingSource(StaticEndpointSource):
    """An endpoint source whose poller does nothing: stands in for EndpointSlice listing."""

    started = 0
    cancelled = 0

    async def run(self, interval_s: float = 2.0) -> None:
        StaticPollingSource.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            StaticPollingSource.cancelled += 1
            raise


async def test_apply_sets_changes_and_removes_routes() -> None:
    router, sources = Router(), {}

    def factory(service: str, namespace: str) -> StaticPollingSource:
        src = sources[(namespace, service)] = StaticPollingSource([Endpoint(f"10.0.0.{len(sources) + 1}:50051")])
        return src

    resources = [idep("llama-a", serving={"servedModelName": "llama", "weight": 100}),
                 idep("llama-cpu", runtime="cpu-int8", serving={"servedModelName": "llama", "tier": "spillover"}),
                 idep("qwen-a", serving={"servedModelName": "qwen"})]
    sync = KubernetesCatalogSync(router, Catalog(), WorkerChannels(), lister=lambda: resources,
                                 source_factory=factory)
    StaticPollingSource.started = StaticPollingSource.cancelled = 0
    resources[0]["status"] = {"conditions": [{"type": "Ready", "status": "False", "reason": "Rollout"}]}
    try:
        await sync.sync_once()  # the listing's conditions are kept by deployment name (the console shows them)
        assert sync.conditions["team-a/llama-a"] == [{"type": "Ready", "status": "False", "reason": "Rollout"}]
        assert sync.conditions["team-a/qwen-a"] == []
        await asyncio.sleep(0)
        assert router.models() == ["llama", "qwen"] and StaticPollingSource.started == 3
        deps = router.deployments("llama")
        assert [(d.name, d.tier, d.weight) for d in deps] == [
            ("team-a/llama-a", Tier.PRIMARY, 100.0), ("team-a/llama-cpu", Tier.SPILLOVER, 100.0)]
        assert deps[0].source is sources[("team-a", "llama-a")]
        # The primary's replica takes traffic; the spillover one only when the primary has none.
        assert router.pick(RouteRequest("llama")).deployment.name == "team-a/llama-a"

        # Same resources again: nothing is rebuilt (the router's hash rings are cached per Deployment).
        sync.apply(resource_routes(resources))
        assert router.deployments("llama")[0] is deps[0]

        # A weight change rebuilds that model's route, over the same endpoint source.
        resources[0] = idep("llama-a", serving={"servedModelName": "llama", "weight": 40})
        sync.apply(resource_routes(resources))
        assert router.deployments("llama")[0].weight == 40.0
        assert router.deployments("llama")[0].source is sources[("team-a", "llama-a")]
        assert StaticPollingSource.started == 3

        # qwen-a deleted: its route goes and its poller stops; llama-cpu deleted: llama keeps llama-a.
        del resources[1:]
        sync.apply(resource_routes(resources))
        await asyncio.sleep(0)
        assert router.models() == ["llama"]
        assert [d.name for d in router.deployments("llama")] == ["team-a/llama-a"]
        assert StaticPollingSource.cancelled == 2
    finally:
        await sync.stop()
    assert StaticPollingSource.cancelled == 3


async def test_a_failing_list_keeps_the_last_state() -> None:
    router = Router()
    calls = {"n": 0}

    def lister() -> list[dict[str, Any]]:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ConnectionError("API server unreachable")
        return [idep("a")]

    sync = KubernetesCatalogSync(router, Catalog(), WorkerChannels(), lister=lister,
                                 source_factory=lambda s, n: StaticPollingSource(), resync_interval=0.01,
                                 endpoint_interval=0.01)
    sync.start()
    try:
        for _ in range(200):
            if calls["n"] >= 3:
                break
            await asyncio.sleep(0.01)
        assert calls["n"] >= 3, "the loop stopped after a failed list"
        assert router.models() == ["llama-8b"]
    finally:
        await sync.stop()


@pytest.mark.parametrize("weight", [0, 100])
def test_weight_is_kept_as_given(weight: int) -> None:
    assert resource_route(idep("a", serving={"weight": weight})).weight == float(weight)


async def test_autoscaled_resources_are_watched_and_held_at_zero() -> None:
    """Issue 14: the cluster sync hands every resource whose spec enables autoscaling to the
    autoscaler (as namespace/name), and has the activator hold requests for a model that may sit at zero."""
    from inferplane.control_plane.autoscale.activator import Activator
    from inferplane.control_plane.autoscale.autoscaler import Autoscaler

    router = Router()
    activator = Activator()
    autoscaler = Autoscaler(router, WorkerChannels(), activator, scaler=None)  # type: ignore[arg-type]
    elastic = idep("chat-a", replicas=1, minReplicas=0, maxReplicas=4, serving={"servedModelName": "chat"},
                   autoscaling={"enabled": True, "queueSize": 7, "queueTimeoutSeconds": 9})
    fixed = idep("qwen-a", serving={"servedModelName": "qwen"})
    sync = KubernetesCatalogSync(router, Catalog(), WorkerChannels(), lister=lambda: [],
                                 source_factory=lambda s, n: StaticPollingSource(), autoscaler=autoscaler)
    try:
        sync.apply(resource_routes([elastic, fixed]))
        assert set(autoscaler.targets) == {"team-a/chat-a"}
        target = autoscaler.targets["team-a/chat-a"]
        assert (target.served_model, target.policy.min_replicas, target.policy.max_replicas) == ("chat", 0, 4)
        assert activator._policies["chat"].queue_size == 7 and "qwen" not in activator._policies
        sync.apply(resource_routes([fixed]))
        assert autoscaler.targets == {} and "chat" not in activator._policies
    finally:
        await sync.stop()
