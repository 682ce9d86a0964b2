"""The pure side: spec parsing, runtime resolved, and the objects built for every example."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from inferplane.api.deployment import InferenceDeploymentSpec, SpecError
from inferplane.api.resolve import resolve
from inferplane.operator import manifests, model_pod
from inferplane.operator.kv_tier import KVTierVolume
from tests.operator.conftest import EXAMPLES, load_example

K8S_VERSION = "1.34.0"  # the chart's minimum (Chart.yaml kubeVersion)
BUILT_IN = {"Deployment", "Service", "PodDisruptionBudget"}  # kubernetes-validate skips custom resources


def build(path: Path) -> tuple[dict, InferenceDeploymentSpec, list[dict]]:
    body = load_example(path)
    body["metadata"]["uid"] = "0f0e0d0c-0000-4000-8000-000000000001"
    spec = InferenceDeploymentSpec.from_dict(body["spec"])
    return body, spec, manifests.children(body, spec, image="registry.example/inferplane:1")


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_children_of_every_example_validate_strictly(path: Path) -> None:
    _, _, objects = build(path)
    assert {o["kind"] for o in objects} == BUILT_IN | {"ServiceMonitor", "PrometheusRule"}
    for obj in objects:
        if obj["kind"] in BUILT_IN:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_worker_container_carries_probes_resources_and_arguments(path: Path) -> None:
    body, spec, objects = build(path)
    resolved = resolve(spec)
    deployment = objects[0]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["inferplane", "worker"]
    assert arg(args, "--runtime") == resolved.runtime
    assert arg(args, "--port") == "50051" and arg(args, "--metrics-port") == "9090"
    assert arg(args, "--device") == ("cuda" if spec.uses_gpu else "cpu")
    assert arg(args, "--served-model-name") == spec.served_model_name(body["metadata"]["name"])
    assert arg(args, "--block-size") == str(spec.engine.block_size)
    if spec.engine.max_num_seqs:
        assert arg(args, "--max-num-seqs") == str(spec.engine.max_num_seqs)
    if spec.engine.kv_cache_memory:
        assert arg(args, "--kv-cache-memory") == spec.engine.kv_cache_memory
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}
    # Liveness must survive a full drain (the worker is NOT_SERVING while it drains).
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > spec.drain_grace_seconds
    assert pod["terminationGracePeriodSeconds"] > spec.drain_grace_seconds
    limits = container["resources"]["limits"]
    assert limits["memory"] == spec.resources.memory and limits["cpu"] == spec.resources.cpu
    # The worker reads its limit to check its footprint before loading (worker/serve/footprint.py).
    env = {e["name"]: e for e in container["env"]}
    assert env["INFERPLANE_MEMORY_LIMIT"]["valueFrom"] == {
        "resourceFieldRef": {"containerName": "worker", "resource": "limits.memory"}}
    assert ("nvidia.com/gpu" in limits) == spec.uses_gpu
    if spec.uses_gpu:
        assert limits["nvidia.com/gpu"] == str(spec.resources.gpus)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    if spec.model.pvc:
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == spec.model.pvc[0]
        assert arg(args, "--model").startswith("/models/")
    # The selector never includes the runtime, so a runtime change can patch the Deployment in place.
    assert deployment["spec"]["selector"]["matchLabels"] == {"inferplane.io/deployment": body["metadata"]["name"]}


def test_building_twice_gives_identical_objects_and_hashes() -> None:
    path = EXAMPLES[0]
    assert build(path)[2] == build(path)[2]


def test_prometheus_rule_follows_the_slo() -> None:
    body, spec, objects = build(next(p for p in EXAMPLES if p.stem == "paged-gpu"))
    rule = next(o for o in objects if o["kind"] == "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["InferplaneTTFTAboveSLO"]["expr"].endswith(f"> {spec.slo.ttft_p95_seconds:g}")
    # The fast burn pages at 14.4x the error budget (errorRatePercent) over 1h and 5m.
    budget = spec.slo.error_rate_percent / 100
    assert f"> {14.4 * budget:g}" in alerts["InferplaneErrorBudgetBurnFast"]["expr"]
    assert f"> {14.4 * (1 - spec.slo.availability / 100):g}" in alerts["InferplaneAvailabilityBurnFast"]["expr"]
    ns, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
    assert all(a["labels"]["namespace"] == ns and a["labels"]["deployment"] == name for a in alerts.values())
    assert f'service="{name}"' in alerts["InferplaneTTFTAboveSLO"]["expr"]


def test_worker_invocation_is_the_container_command_line() -> None:
    body, spec, objects = build(EXAMPLES[0])
    invocation = manifests.worker_invocation(body["metadata"]["name"], spec)
    container = objects[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] + container["args"] == invocation.command + invocation.args
    local = manifests.worker_invocation(body["metadata"]["name"], spec, port=6000, host="127.0.0.1")
    assert arg(local.args, "--port") == "6000" and arg(local.args, "--host") == "127.0.0.1"


@pytest.mark.parametrize(("spec", "hints", "runtime"), [
    ({"resources": {"gpus": 0}}, {}, "cpu-int8"),
    ({"resources": {"gpus": 1}}, {"multiTurn": True}, "radix"),
    ({"resources": {"gpus": 1}}, {"sharedPrefix": True}, "radix"),
    ({"resources": {"gpus": 1}}, {"agent": True}, "radix"),
    ({"resources": {"gpus": 1}}, {}, "paged"),
])
def test_auto_selection(spec: dict, hints: dict, runtime: str) -> None:
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "runtime": "auto", "workload": hints, **spec})
    resolved = resolve(parsed)
    assert resolved.runtime == runtime
    assert resolved.reason.startswith("auto:")


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"model": {"name": "m", "uri": "/w"}}, "model", "exactly one"),
    ({"model": {"uri": "/w"}}, "model.format", "required"),
    ({"model": {"name": "m"}, "minReplicas": 3, "maxReplicas": 2}, "minReplicas", "must not exceed"),
    ({"model": {"name": "m"}, "runtime": "cpu-int8", "resources": {"gpus": 1}}, "resources.gpus", "cpu-int8"),
    ({"model": {"name": "m"}, "engine": {"kvCacheMemory": "0.9"}}, "engine.kvCacheMemory", "fraction"),
    ({"model": {"name": "m"}, "resources": {"memory": "2Gi"}, "engine": {"kvCacheMemory": "4GiB"}},
     "engine.kvCacheMemory", "does not fit"),
    ({"model": {"name": "m"}, "engine": {"blockSize": 12}}, "engine.blockSize", "one of"),
    ({"model": {"name": "m"}, "replicas": True}, "replicas", "boolean"),
    ({"model": {"name": "m"}, "runtime": "radix", "engine": {"quantizeHead": False}}, "engine.quantizeHead",
     "cpu-int8"),
    ({"model": {"name": "m"}, "engine": {"quantizeHead": "yes"}}, "engine.quantizeHead", "expected bool"),
    ({"model": {"name": "m"}, "runtime": "paged", "engine": {"decodeSteps": 4}}, "engine.decodeSteps", "cpu-int8"),
    ({"model": {"name": "m"}, "engine": {"decodeSteps": 65}}, "engine.decodeSteps", "64"),
    ({"model": {"name": "m"}, "runtime": "paged", "engine": {"kvOffloadMemory": "1GiB"}}, "engine.kvOffloadMemory",
     "radix KV manager"),
    ({"model": {"name": "m"}, "engine": {"kvOffloadDisk": "lots"}}, "engine.kvOffloadDisk", "byte size"),
    ({"model": {"name": "m"}, "autoscaling": {"panicWindowSeconds": 90}}, "autoscaling.panicWindowSeconds",
     "shorter than"),
    ({"model": {"name": "m"}, "autoscaling": {"idleSeconds": -5}}, "autoscaling.idleSeconds", "at least 0"),
    ({"model": {"name": "m"}, "minReplicas": 2, "maxReplicas": 1, "replicas": 1}, "minReplicas", "must not exceed"),
])
def test_invalid_specs_name_the_field(spec: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        InferenceDeploymentSpec.from_dict(spec)
    assert caught.value.field == field
    assert words in str(caught.value) and f"spec.{field}" in str(caught.value)


@pytest.mark.parametrize(("spec", "steps"), [
    ({"runtime": "cpu-int8"}, "8"),  # unset: the preset's
    ({"runtime": "cpu-int8", "engine": {"decodeSteps": 1}}, "1"),
    ({"runtime": "auto", "resources": {"gpus": 0}, "engine": {"decodeSteps": 3}}, "3"),  # auto picks cpu-int8
    ({"runtime": "auto", "resources": {"gpus": 1}, "engine": {"decodeSteps": 3}}, "1"),  # ... or a GPU runtime
    ({"runtime": "paged"}, "1"),
])
def test_decode_steps_reach_the_cpu_int8_worker_only(spec: dict, steps: str) -> None:
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec})
    args = manifests.worker_invocation("edge", parsed, port=6000, host="127.0.0.1").args
    assert args[args.index("--decode-steps") + 1] == steps


@pytest.mark.parametrize(("spec", "passed"), [
    ({"runtime": "cpu-int8", "engine": {"quantizeHead": False}}, True),
    ({"runtime": "auto", "resources": {"gpus": 0}, "engine": {"quantizeHead": False}}, True),  # auto picks cpu-int8
    ({"runtime": "auto", "resources": {"gpus": 1}, "engine": {"quantizeHead": False}}, False),  # ... or a GPU runtime
    ({"runtime": "cpu-int8"}, False),  # unset: the worker's default, the int8 head
])
def test_quantize_head_reaches_the_cpu_int8_worker_only(spec: dict, passed: bool) -> None:
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **spec})
    invocation = manifests.worker_invocation("edge", parsed, port=6000, host="127.0.0.1")
    assert ("--no-quantize-head" in invocation.args) is passed
    assert "--quantize-head" not in invocation.args
    requant = {**spec, "engine": {"requantizeQ4": True}}
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, **requant})
    invocation = manifests.worker_invocation("edge", parsed, port=6000, host="127.0.0.1")
    assert ("--requantize-q4" in invocation.args) is (passed or spec == {"runtime": "cpu-int8"})


def test_kv_tiers_reach_the_worker_with_their_volume() -> None:
    """engine.kvOffload*: the worker's flags, and for the disk tier an emptyDir of that size, mounted
    where --kv-offload-dir says and requested as ephemeral storage; auto on a GPU picks radix."""
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "resources": {"gpus": 1},
                                                "engine": {"kvOffloadMemory": "2GiB", "kvOffloadDisk": "20Gi"}})
    resolved = resolve(parsed)
    assert resolved.runtime == "radix" and "KV tiers" in resolved.reason
    args = manifests.worker_invocation("edge", parsed).args
    assert args[args.index("--kv-offload-memory") + 1] == "2GiB"
    assert args[args.index("--kv-offload-disk") + 1] == "20Gi"
    assert args[args.index("--kv-offload-dir") + 1] == manifests.KV_TIER_DIR
    pod = manifests.worker_pod_spec("edge", parsed, resolved=resolved, image="img",
                                    weights=model_pod.plan(parsed, None, image="img"))
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    assert volume == {"name": "kv-tier", "emptyDir": {"sizeLimit": str(20 * 2**30 * 11 // 10)}}
    container = pod["containers"][0]
    assert {"name": "kv-tier", "mountPath": manifests.KV_TIER_DIR} in container["volumeMounts"]
    assert container["resources"]["requests"]["ephemeral-storage"] == str(20 * 2**30)
    assert "ephemeral-storage" not in container["resources"]["limits"]
    # Without a disk tier: no volume, no directory flag.
    plain = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "engine": {"kvOffloadMemory": "1GiB"}})
    assert "--kv-offload-dir" not in manifests.worker_invocation("edge", plain).args
    plain_pod = manifests.worker_pod_spec("edge", plain, resolved=resolve(plain), image="img",
                                          weights=model_pod.plan(plain, None, image="img"))
    assert all(v["name"] != "kv-tier" for v in plain_pod["volumes"])



def test_a_kv_tier_on_a_node_directory_or_claim_outlives_the_pod_in_a_folder_per_deployment() -> None:
    """The operator's --kv-tier-host-path / --kv-tier-pvc: the deployment's folder in that volume, no
    ephemeral storage request (it is not the node's ephemeral storage), one folder per namespace and name."""
    parsed = InferenceDeploymentSpec.from_dict({"model": {"name": "m"}, "engine": {"kvOffloadDisk": "8Gi"}})
    body = {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"}, "spec": {}}
    for node_volume, expected in ((KVTierVolume(host_path="/srv/kv"),
                                   {"name": "kv-tier", "hostPath": {"path": "/srv/kv", "type": "Directory"}}),
                                  (KVTierVolume(claim="kv-claim"),
                                   {"name": "kv-tier", "persistentVolumeClaim": {"claimName": "kv-claim"}})):
        objects = manifests.children(body, parsed, kv_volume=node_volume)
        pod = objects[0]["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
        assert volume == expected
        container = pod["containers"][0]
        assert container["args"][container["args"].index("--kv-offload-dir") + 1] == \
            f"{manifests.KV_TIER_DIR}/team-a/chat"
        assert "ephemeral-storage" not in container["resources"]["requests"]
    # The default stays a pod's own emptyDir, requested as ephemeral storage.
    pod = manifests.children(body, parsed)[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == str(8 * 2**30)
