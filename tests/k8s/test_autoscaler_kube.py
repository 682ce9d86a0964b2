"""Issue 14 on Kubernetes, against the real kube-apiserver: the autoscaler scales an
InferenceDeployment through its scale subresource, records the decision (Event, status.autoscaler),
and only the holder of the Lease decides; a second control-plane replica takes over once the first
stops renewing.
"""

from __future__ import annotations

import asyncio

from kubernetes import client as k8s

from inferplane.api.resolve import PRESETS
from inferplane.control_plane.autoscale.activator import Activator
from inferplane.control_plane.autoscale.autoscaler import Autoscaler, ScaleTarget
from inferplane.control_plane.autoscale.decision import Policy
from inferplane.control_plane.autoscale.kube import KubernetesScaler, LeaseElector
from inferplane.control_plane.autoscale.signals import Targets
from inferplane.control_plane.gateway.kube_sync import load_api_client
from inferplane.control_plane.routing import Deployment, Endpoint, Router, StaticEndpointSource
from inferplane.control_plane.routing.worker_channels import WorkerChannels
from tests.k8s.cluster import Cluster, wait_for
from tests.k8s.conftest import idep, idep_path, namespace

SERVED = "chat"


def autoscaler(api_client, ns: str, elector: LeaseElector) -> tuple[Autoscaler, Activator]:
    router = Router()
    router.set_route(SERVED, [Deployment(f"{ns}/chat", StaticEndpointSource([]))])  # no replica: nothing to poll
    activator = Activator()
    scaler = Autoscaler(router, WorkerChannels(), activator, KubernetesScaler(api_client), is_leader=elector.is_leader)
    scaler.watch(ScaleTarget(name=f"{ns}/chat", served_model=SERVED, deployment=f"{ns}/chat",
                             policy=Policy(min_replicas=0, max_replicas=5, stable_window=6, panic_window=2),
                             targets=Targets(queue_depth=1), slots=PRESETS["cpu-int8"].max_num_seqs))
    return scaler, activator


def test_the_lease_holder_scales_through_the_subresource_and_says_why(cluster: Cluster, crds: Cluster) -> None:
    with namespace(cluster, "autoscale") as ns:
        cluster.apply(idep("chat", ns, replicas=0, minReplicas=0, maxReplicas=5,
                           autoscaling={"enabled": True, "stableWindowSeconds": 6, "panicWindowSeconds": 2}))
        api_client = load_api_client(str(cluster.admin_kubeconfig))
        first = LeaseElector(api_client, ns, identity="gateway-a", duration=3)
        second = LeaseElector(api_client, ns, identity="gateway-b", duration=3)
        assert first.try_acquire() and not second.try_acquire()
        leader, held_a = autoscaler(api_client, ns, first)
        follower, held_b = autoscaler(api_client, ns, second)
        held_a._held[SERVED] = held_b._held[SERVED] = 3  # three requests wait at zero replicas, on both

        async def ticks() -> None:
            await follower.tick()  # not the leader: samples, decides nothing
            assert cluster.get(idep_path(ns, "chat"))["spec"]["replicas"] == 0
            await leader.tick()

        asyncio.run(ticks())
        body = cluster.get(idep_path(ns, "chat"))
        assert body["spec"]["replicas"] == 3, body["spec"]
        scale = cluster.get(idep_path(ns, "chat") + "/scale")
        assert scale["spec"]["replicas"] == 3
        status = body["status"]["autoscaler"]
        assert (status["desiredReplicas"], status["currentReplicas"], status["panic"]) == (3, 0, True), status
        assert status["saturation"] > 0 and status["reason"] and status["lastScaleTime"]
        events = cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
        scaled = [e for e in events if e["involvedObject"]["name"] == "chat" and e["reason"] == "ScaledUp"]
        assert scaled and "0 -> 3" in scaled[0]["message"], events
        lease = k8s.CoordinationV1Api(api_client).read_namespaced_lease("inferplane-autoscaler", ns)
        assert lease.spec.holder_identity == "gateway-a"

        # Down: the replica chosen (least loaded) is the pod the ReplicaSet removes first.
        cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chat-idle", "namespace": ns},
                       "spec": {"containers": [{"name": "worker", "image": "inferplane:test"}]}})
        decision = leader.targets[f"{ns}/chat"].last
        asyncio.run(KubernetesScaler(api_client).scale(f"{ns}/chat", 1, decision,
                                                       [Endpoint("10.0.0.9:50051", name="chat-idle")]))
        assert cluster.get(idep_path(ns, "chat"))["spec"]["replicas"] == 1
        pod = cluster.get(f"/api/v1/namespaces/{ns}/pods/chat-idle")
        assert pod["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"] == "-1000"
        events = cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
        assert any(e["reason"] == "ScaledDown" and "3 -> 1" in e["message"] for e in events), events

        # The holder stops renewing: after the lease duration the other replica takes over.
        wait_for(second.try_acquire, 30, "the second replica taking the lease", interval=0.5)
        assert not first.try_acquire() and not first.is_leader()
        lease = k8s.CoordinationV1Api(api_client).read_namespaced_lease("inferplane-autoscaler", ns)
        assert lease.spec.holder_identity == "gateway-b" and lease.spec.lease_transitions == 1


def test_a_prefill_pool_is_scaled_through_its_own_field(cluster: Cluster, crds: Cluster) -> None:
    """A disaggregated deployment's prefill pool (scaler name namespace/name/prefill) is scaled by a
    patch of spec.disaggregation.prefill.replicas, the decode pool's spec.replicas untouched."""
    from inferplane.control_plane.autoscale.decision import Decision
    from inferplane.control_plane.autoscale.kube import prefill_target

    with namespace(cluster, "autoscale-prefill") as ns:
        cluster.apply(idep("chat", ns, runtime="cpu-int8", replicas=2, maxReplicas=2,
                           disaggregation={"enabled": True, "prefill": {"replicas": 1, "maxReplicas": 4}}))
        scaler = KubernetesScaler(load_api_client(str(cluster.admin_kubeconfig)))
        name = prefill_target(f"{ns}/chat")
        decision = Decision(desired=3, panic=False, reason="prefill queue", stable_load=2.5, panic_load=2.5)

        async def scale() -> int:
            before = await scaler.current(name)
            await scaler.scale(name, 3, decision)
            return before

        assert asyncio.run(scale()) == 1
        spec = cluster.get(idep_path(ns, "chat"))["spec"]
        assert spec["disaggregation"]["prefill"]["replicas"] == 3 and spec["replicas"] == 2
        assert asyncio.run(scaler.current(name)) == 3
        events = cluster.get(f"/api/v1/namespaces/{ns}/events")["items"]
        assert any(e["reason"] == "ScaledUp" and "prefill replicas 1 -> 3" in e["message"] for e in events), events
