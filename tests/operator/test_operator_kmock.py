"""The real kopf operator against the in-memory API (kmock + tests.operator.fakeapi).

Each test drives the API the way kubectl, the Deployment controller or the autoscaler would, and
checks what the operator did in response.
"""

from __future__ import annotations

import copy
from typing import Any

from inferplane.operator.manifests import ANNOTATION_HASH
from tests.operator.conftest import NAMESPACE, eventually

IDEPS = "inferplane.io/v1alpha1/inferencedeployments"
BASE = f"/apis/inferplane.io/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments"
CHILDREN = ["apps/v1/deployments", "v1/services", "policy/v1/poddisruptionbudgets",
            "monitoring.coreos.com/v1/servicemonitors", "monitoring.coreos.com/v1/prometheusrules"]


def resource(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"name": "smollm2-135m"}, **spec}}


async def create(api: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with api.clients[0].post(BASE, json=body) as response:
        return response.status, await response.json()


async def patch(api: Any, path: str, body: Any, content_type: str = "application/merge-patch+json") -> int:
    async with api.clients[0].patch(path, json=body, headers={"Content-Type": content_type}) as response:
        return response.status


def status_of(api: Any, name: str) -> dict[str, Any]:
    obj = api.get(IDEPS, NAMESPACE, name) or {}
    return obj.get("status") or {}


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == ctype), {})


async def test_create_makes_owned_children_and_reports_progressing(operator: Any) -> None:
    code, created = await create(operator, resource("chat", resources={"gpus": 1}, workload={"multiTurn": True}))
    assert code in (200, 201), created
    uid = created["metadata"]["uid"]

    await eventually(lambda: all(operator.get(kind, NAMESPACE, "chat") for kind in CHILDREN))
    for kind in CHILDREN:
        refs = operator.get(kind, NAMESPACE, "chat")["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "name": "chat",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}]

    status = await eventually(lambda: status_of(operator, "chat").get("phase") and status_of(operator, "chat"))
    assert status["phase"] == "Progressing"
    assert condition(status, "Progressing")["status"] == "True"
    assert condition(status, "Ready")["status"] == "False"
    assert status["selectedRuntime"] == "radix" and "multiTurn" in status["runtimeReason"]
    assert status["observedGeneration"] == 1
    container = operator.get("apps/v1/deployments", NAMESPACE, "chat")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--runtime") + 1] == "radix"
    assert container["image"] == "registry.example/inferplane:test"
    assert "chat" in operator.get(IDEPS, NAMESPACE, "chat")["metadata"]["name"]
    assert "inferplane.io/finalizer" in operator.get(IDEPS, NAMESPACE, "chat")["metadata"]["finalizers"]


async def test_ready_workers_make_the_resource_ready_with_endpoints(operator: Any) -> None:
    await create(operator, resource("edge"))
    await eventually(lambda: status_of(operator, "edge").get("phase") == "Progressing")
    assert status_of(operator, "edge")["endpoints"] == []

    # What the Deployment controller would report once the pod passes its gRPC readiness probe.
    deployment_status = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/edge/status"
    code = await patch(operator, deployment_status, {"status": {
        "observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}})
    assert code == 200

    status = await eventually(
        lambda: status_of(operator, "edge").get("phase") == "Ready" and status_of(operator, "edge"))
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "WorkersReady")
    assert condition(status, "Progressing")["status"] == "False"
    assert condition(status, "Degraded")["status"] == "False"
    assert status["readyReplicas"] == 1
    assert status["endpoints"] == [f"edge.{NAMESPACE}.svc:50051"]
    assert status["selectedRuntime"] == "cpu-int8"


async def test_runtime_change_rolls_only_the_deployment(operator: Any) -> None:
    await create(operator, resource("gpu", runtime="paged", resources={"gpus": 1}))
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "gpu") for kind in CHILDREN))
    before = {kind: copy.deepcopy(operator.get(kind, NAMESPACE, "gpu")) for kind in CHILDREN}
    mark = len(operator._requests)

    assert await patch(operator, f"{BASE}/gpu", {"spec": {"runtime": "radix"}}) == 200

    def rolled() -> bool:
        pod = operator.get("apps/v1/deployments", NAMESPACE, "gpu")["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        return args[args.index("--runtime") + 1] == "radix"

    await eventually(rolled)
    await eventually(lambda: status_of(operator, "gpu").get("selectedRuntime") == "radix")
    after = {kind: operator.get(kind, NAMESPACE, "gpu") for kind in CHILDREN}
    deployment = after["apps/v1/deployments"]
    assert deployment["metadata"]["uid"] == before["apps/v1/deployments"]["metadata"]["uid"]  # patched, not recreated
    assert deployment["metadata"]["annotations"][ANNOTATION_HASH] != \
        before["apps/v1/deployments"]["metadata"]["annotations"][ANNOTATION_HASH]
    assert deployment["spec"]["template"]["metadata"]["labels"]["inferplane.io/runtime"] == "radix"
    for kind in CHILDREN[1:]:
        assert after[kind] == before[kind], f"{kind} changed although its content did not"
    writes = [r for r in operator._requests[mark:]
              if str(r.method).endswith(("POST", "PATCH", "DELETE")) and r.resource is not None
              and r.resource.plural not in ("inferencedeployments", "deployments", "events")]
    assert writes == [], [str(w.url) for w in writes]


async def test_scale_subresource_sets_worker_replicas(operator: Any) -> None:
    await create(operator, resource("scaled", maxReplicas=4))
    await eventually(lambda: operator.get("apps/v1/deployments", NAMESPACE, "scaled"))

    # The control plane's autoscaler (and `kubectl scale`) write the scale subresource.
    assert await patch(operator, f"{BASE}/scaled/scale", {"spec": {"replicas": 3}}) == 200
    await eventually(lambda: operator.get("apps/v1/deployments", NAMESPACE, "scaled")["spec"]["replicas"] == 3)
    async with operator.clients[0].get(f"{BASE}/scaled/scale") as response:
        scale = await response.json()
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == "inferplane.io/deployment=scaled"
    assert operator.get(IDEPS, NAMESPACE, "scaled")["metadata"]["generation"] == 2


async def test_delete_runs_the_finalizer_and_removes_children(operator: Any) -> None:
    await create(operator, resource("gone"))
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "gone") for kind in CHILDREN))
    await eventually(lambda: "inferplane.io/finalizer" in
                     (operator.get(IDEPS, NAMESPACE, "gone")["metadata"].get("finalizers") or []))

    async with operator.clients[0].delete(f"{BASE}/gone") as response:
        assert response.status == 200
    # The finalizer holds the object until the delete handler has run, then releases it.
    await eventually(lambda: operator.get(IDEPS, NAMESPACE, "gone") is None)
    assert all(operator.get(kind, NAMESPACE, "gone") is None for kind in CHILDREN)
    deletes = {r.resource.plural for r in operator._requests
               if str(r.method).endswith("DELETE") and r.resource is not None and r.name == "gone"}
    assert {"deployments", "services", "poddisruptionbudgets"} <= deletes  # done by the finalizer itself


async def test_admission_webhook_refuses_what_the_schema_cannot_express(operator: Any) -> None:
    # Valid for the schema and CEL, but a KV fraction means "of free GPU memory", and there is no GPU.
    code, body = await create(operator, resource("nogpu", engine={"kvCacheMemory": "0.9"}))
    assert code == 422, body
    assert 'admission webhook "validate-spec.inferplane.io" denied the request' in body["message"]
    assert "spec.engine.kvCacheMemory" in body["message"] and "resources.gpus is 0" in body["message"]
    assert operator.get(IDEPS, NAMESPACE, "nogpu") is None

    # Updates are admitted too: an accepted resource cannot be patched into an invalid one.
    assert (await create(operator, resource("cpu", resources={"memory": "4Gi"})))[0] == 200
    code = await patch(operator, f"{BASE}/cpu", {"spec": {"engine": {"kvCacheMemory": "6GiB"}}})
    assert code == 422
    assert "kvCacheMemory" not in str(operator.get(IDEPS, NAMESPACE, "cpu")["spec"].get("engine"))


async def test_schema_and_cel_rules_refuse_with_reasons(operator: Any) -> None:
    code, body = await create(operator, resource("bad", runtime="cpu-int8", resources={"gpus": 1}))
    assert code == 422
    assert "runtime cpu-int8 runs on CPU" in body["message"]
    code, body = await create(operator, resource("bad2", runtime="tensorrt"))
    assert code == 422 and "spec.runtime" in body["message"] and "tensorrt" in body["message"]


async def test_restarted_operator_resumes_without_rewriting_children(fake_api: Any) -> None:
    from inferplane.operator.config import OperatorConfig
    from tests.operator.fakeapi import running_operator

    api, kubeconfig = fake_api
    config = OperatorConfig(post_events=False)
    async with running_operator(api, kubeconfig, config, namespaces=[NAMESPACE]):
        await create(api, resource("steady"))
        await eventually(lambda: status_of(api, "steady").get("phase") == "Progressing")
    mark = len(api._requests)
    async with running_operator(api, kubeconfig, config, namespaces=[NAMESPACE]):
        # The resume handler reconciles; every child's hash matches, so nothing is written.
        await eventually(lambda: any(r.method == "GET" and r.name == "steady" and r.resource.plural == "prometheusrules"
                                     for r in api._requests[mark:] if r.resource is not None))
    writes = [r for r in api._requests[mark:] if str(r.method).endswith(("POST", "PATCH"))
              and r.resource is not None and r.resource.plural in {k.rsplit("/", 1)[1] for k in CHILDREN}]
    assert writes == []
