"""The objects of a disaggregated InferenceDeployment: the decode pool as before, the prefill pool beside it."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from inferplane.api.deployment import InferenceDeploymentSpec, prefill_pool_name
from inferplane.api.resolve import prefill_spec, resolve
from inferplane.operator import manifests
from inferplane.operator.manifests import (
    ANNOTATION_SERVED_MODEL,
    LABEL_DEPLOYMENT,
    LABEL_POOL,
    POOL_DECODE,
    POOL_PREFILL,
)
from tests.operator.conftest import EXAMPLES, load_example
from tests.operator.test_manifests import K8S_VERSION

BODY = {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "0f0e0d0c-0000-4000-8000-000000000002"}}
PREFILL_RESOURCES = {"cpu": "8", "memory": "16Gi"}
DISAGGREGATED = {"model": {"name": "smollm2-135m"}, "replicas": 2, "maxReplicas": 4,
                 "resources": {"cpu": "4", "memory": "8Gi"},
                 "disaggregation": {"enabled": True, "prefill": {"replicas": 3, "resources": PREFILL_RESOURCES}}}


def build(spec: dict[str, Any], *, monitoring: bool = True) -> dict[tuple[str, str], dict[str, Any]]:
    parsed = InferenceDeploymentSpec.from_dict(spec)
    objects = manifests.children({**BODY, "spec": spec}, parsed, image="img", monitoring=monitoring)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_the_prefill_pool_has_its_own_deployment_service_budget_and_monitor() -> None:
    objects = build(DISAGGREGATED)
    assert set(objects) == {(kind, name) for kind in ("Deployment", "Service", "PodDisruptionBudget",
                                                      "ServiceMonitor") for name in ("chat", "chat-prefill")
                            } | {("PrometheusRule", "chat")}
    assert prefill_pool_name("chat") == "chat-prefill"
    for obj in objects.values():
        assert obj["metadata"]["ownerReferences"] == [manifests.Owner.from_body(BODY).reference()]
        assert len(obj["metadata"]["annotations"][manifests.ANNOTATION_HASH]) == 16
        assert obj["metadata"]["namespace"] == "team-a"
        if obj["kind"] in ("Deployment", "Service", "PodDisruptionBudget"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The decode pool's children are listed first, as before: reconcile reads the first as the workers.
    assert list(objects)[0] == ("Deployment", "chat")


def test_no_selector_of_the_decode_pool_matches_a_prefill_pod_and_the_reverse() -> None:
    objects = build(DISAGGREGATED)
    decode_pod = objects["Deployment", "chat"]["spec"]["template"]["metadata"]["labels"]
    prefill_pod = objects["Deployment", "chat-prefill"]["spec"]["template"]["metadata"]["labels"]
    assert decode_pod[LABEL_POOL] == POOL_DECODE and prefill_pod[LABEL_POOL] == POOL_PREFILL
    assert decode_pod[LABEL_DEPLOYMENT] == "chat" and prefill_pod[LABEL_DEPLOYMENT] == "chat-prefill"
    # The instance is the InferenceDeployment's, for both pools.
    assert prefill_pod["app.kubernetes.io/instance"] == decode_pod["app.kubernetes.io/instance"] == "chat"
    for name, own, other in (("chat", decode_pod, prefill_pod), ("chat-prefill", prefill_pod, decode_pod)):
        for selector in (objects["Deployment", name]["spec"]["selector"]["matchLabels"],
                         objects["Service", name]["spec"]["selector"],
                         objects["PodDisruptionBudget", name]["spec"]["selector"]["matchLabels"]):
            assert selector == {LABEL_DEPLOYMENT: name}
            assert matches(selector, own) and not matches(selector, other)
        monitor = objects["ServiceMonitor", name]["spec"]["selector"]["matchLabels"]
        services = [key for key, obj in objects.items() if key[0] == "Service"
                    and matches(monitor, obj["metadata"]["labels"])]
        assert services == [("Service", name)]


def test_the_prefill_deployment_runs_the_same_worker_on_its_replicas_and_resources() -> None:
    objects = build(DISAGGREGATED)
    decode, prefill = objects["Deployment", "chat"], objects["Deployment", "chat-prefill"]
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (2, 3)
    (decode_worker,) = decode["spec"]["template"]["spec"]["containers"]
    (prefill_worker,) = prefill["spec"]["template"]["spec"]["containers"]
    assert prefill_worker["resources"] == {"requests": PREFILL_RESOURCES, "limits": PREFILL_RESOURCES}
    assert decode_worker["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}
    # The same command line (both keep the KV memory tier the pools move KV through), the same
    # served name; only the CPU threads follow each pool's CPU.
    assert prefill_worker["args"] == decode_worker["args"]
    args = prefill_worker["args"]
    assert args[args.index("--served-model-name") + 1] == "smollm2-135m"
    assert "--kv-offload-memory" in args
    env = {e["name"]: e.get("value") for e in prefill_worker["env"]}
    assert env["OMP_NUM_THREADS"] == "8"
    assert {e["name"]: e.get("value") for e in decode_worker["env"]}["OMP_NUM_THREADS"] == "4"
    assert prefill_worker["ports"] == decode_worker["ports"]
    decode_pod = {k: v for k, v in decode["spec"]["template"]["spec"].items() if k != "containers"}
    prefill_pod = {k: v for k, v in prefill["spec"]["template"]["spec"].items() if k != "containers"}
    assert prefill_pod == decode_pod


def test_without_its_own_resources_the_prefill_pool_takes_the_specs() -> None:
    spec = {**DISAGGREGATED, "disaggregation": {"enabled": True}}
    objects = build(spec)
    prefill = objects["Deployment", "chat-prefill"]
    assert prefill["spec"]["replicas"] == 1
    assert prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "4", "memory": "8Gi"}


def test_the_prefill_service_serves_no_model() -> None:
    """Nothing that lists Services by the served-model annotation may take the prefill pool for a deployment."""
    objects = build(DISAGGREGATED)
    decode, prefill = objects["Service", "chat"], objects["Service", "chat-prefill"]
    assert decode["metadata"]["annotations"][ANNOTATION_SERVED_MODEL] == "smollm2-135m"
    assert set(prefill["metadata"]["annotations"]) == {manifests.ANNOTATION_HASH}
    assert prefill["spec"]["clusterIP"] == "None"
    assert prefill["spec"]["ports"] == decode["spec"]["ports"]
    assert [p["name"] for p in prefill["spec"]["ports"]] == ["grpc", "metrics"]
    assert prefill["metadata"]["labels"][LABEL_POOL] == POOL_PREFILL
    assert LABEL_POOL not in decode["metadata"]["labels"]


def test_without_monitoring_the_prefill_pool_has_no_service_monitor() -> None:
    assert set(build(DISAGGREGATED, monitoring=False)) == {
        (kind, name) for kind in ("Deployment", "Service", "PodDisruptionBudget") for name in ("chat", "chat-prefill")}


def test_the_decode_pools_objects_keep_their_labels_and_selectors() -> None:
    """Enabling disaggregation changes the decode pods' template (the pool label, the KV tier), never
    an immutable selector, nor the labels of the decode pool's other objects."""
    plain = build({**DISAGGREGATED, "disaggregation": {"enabled": False}})
    split = build(DISAGGREGATED)
    for key, obj in plain.items():
        assert split[key]["metadata"]["labels"] == obj["metadata"]["labels"], key
        assert split[key]["metadata"]["name"] == obj["metadata"]["name"]
    assert split["Deployment", "chat"]["spec"]["selector"] == plain["Deployment", "chat"]["spec"]["selector"]
    for kind in ("Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"):
        assert split[kind, "chat"]["spec"] == plain[kind, "chat"]["spec"], kind


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_a_spec_that_is_not_disaggregated_builds_what_it_did_before(path: Any) -> None:
    """No new object and no new label: the prefill section, left out or disabled, changes nothing."""
    body = load_example(path)
    body["metadata"]["uid"] = "u1"
    spec = InferenceDeploymentSpec.from_dict(body["spec"])
    objects = manifests.children(body, spec, image="img")
    assert [o["metadata"]["name"] for o in objects] == [body["metadata"]["name"]] * len(objects)
    for obj in objects:
        assert LABEL_POOL not in obj["metadata"]["labels"]
    pod = objects[0]["spec"]["template"]
    assert LABEL_POOL not in pod["metadata"]["labels"]
    # A disabled section with its own prefill settings builds exactly the same objects.
    body["spec"]["disaggregation"] = {"enabled": False, "prefill": {
        "replicas": 5, "resources": {"cpu": "16", "gpus": spec.resources.gpus}}}
    disabled = InferenceDeploymentSpec.from_dict(body["spec"])
    assert manifests.children(body, disabled, image="img") == objects


def test_possible_children_cover_what_children_build() -> None:
    """What the finalizer deletes and reconcile prunes: every child of either shape, the Deployments first."""
    for monitoring in (True, False):
        possible = manifests.possible_children("chat", "team-a", monitoring=monitoring)
        keys = [(p["kind"], p["metadata"]["name"]) for p in possible]
        assert set(keys) == set(build(DISAGGREGATED, monitoring=monitoring))
        assert keys[:2] == [("Deployment", "chat"), ("Deployment", "chat-prefill")]
        assert all(p["metadata"]["namespace"] == "team-a" for p in possible)


def test_the_prefill_pods_resolve_their_threads_from_their_own_cpu() -> None:
    spec = InferenceDeploymentSpec.from_dict(DISAGGREGATED)
    assert resolve(prefill_spec(spec)).cpu_threads == 8 and resolve(spec).cpu_threads == 4
