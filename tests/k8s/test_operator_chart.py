"""The chart installed by helm into a real API server, and its operator at work with its own credentials.

`helm install` puts the whole release in (the server checks every object and the chart's
kubeVersion against its own version). The operator then runs as the chart's container would run
it: the same arguments, authenticated as the chart's ServiceAccount by a token from the TokenRequest
API, so RBAC is the chart's and nothing more. What differs, because no pod runs here: the process
runs on this machine, with local copies of the webhook's TLS files and a free port; and the chart's
operator Service, which nothing could route to a pod, is replaced by an ExternalName Service for
`localhost`, so the API server still dials the webhook through the Service reference the operator
registers, and checks its certificate against `<service>.<namespace>.svc`.

The last test reads the API server's audit log: any request of the operator that was refused (403)
fails it, and so does any permission the chart grants that the operator never used.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferplane.operator.manifests import ANNOTATION_HASH
from tests.k8s.cluster import Cluster, free_port, kubernetes_version
from tests.k8s.conftest import CHART, ROOT, OperatorProcess, idep, idep_path, namespace, run_kubectl
from tests.operator import crd

RELEASE, RELEASE_NS, WATCHED = "inferplane", "inferplane", "team-a"
SERVICE = f"{RELEASE}-operator"  # the operator's ServiceAccount, Service and Deployment
OPERATOR_USER = f"system:serviceaccount:{RELEASE_NS}:{SERVICE}"
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
CHILDREN = {  # kind -> REST collection in the watched namespace
    "Deployment": f"/apis/apps/v1/namespaces/{WATCHED}/deployments",
    "Service": f"/api/v1/namespaces/{WATCHED}/services",
    "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{WATCHED}/poddisruptionbudgets",
    "ServiceMonitor": f"/apis/monitoring.coreos.com/v1/namespaces/{WATCHED}/servicemonitors",
    "PrometheusRule": f"/apis/monitoring.coreos.com/v1/namespaces/{WATCHED}/prometheusrules",
}
TIMEOUT = 120.0


def helm_cmd(helm: Path, cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), f"--kubeconfig={cluster.admin_kubeconfig}", *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr or result.stdout
    return result


def operator_args(manifest: str, webhook_files: dict[str, Path]) -> list[str]:
    """The chart operator container's arguments, with what points into a pod replaced by local values."""
    (deployment,) = [doc for doc in yaml.safe_load_all(manifest)
                     if doc and doc["kind"] == "Deployment" and doc["metadata"]["name"] == f"{RELEASE}-operator"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["inferplane", "operator"]
    local = {"--webhook-port": str(webhook_files["port"]), "--liveness": "",
             "--webhook-cert": str(webhook_files["tls.crt"]), "--webhook-key": str(webhook_files["tls.key"]),
             "--webhook-ca": str(webhook_files["ca.crt"])}
    args = []
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        args.append(f"{flag}={local[flag]}" if flag in local else arg)
    assert {a.split("=", 1)[0] for a in args} >= set(local), args  # the chart enables every replaced flag
    assert f"--webhook-service={RELEASE_NS}/{SERVICE}" in args, args
    return args


@pytest.fixture(scope="module", params=["namespaced", "cluster"])
def release(request: pytest.FixtureRequest, crds: Cluster, helm: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Any]]:
    """`helm install` with the webhook on, in either RBAC mode: Roles in team-a (watched alone), or a
    ClusterRole and --all-namespaces. Every test of this module runs once per mode."""
    cluster = crds
    files = tmp_path_factory.mktemp("webhook")
    cert, key = cluster.ca.issue(files, "tls", dns=(f"{SERVICE}.{RELEASE_NS}.svc",))
    (files / "ca.crt").write_bytes(cluster.ca.pem())
    webhook_files = {"tls.crt": cert, "tls.key": key, "ca.crt": files / "ca.crt"}
    with namespace(cluster, RELEASE_NS), namespace(cluster, WATCHED):
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                       "metadata": {"name": "operator-webhook-tls", "namespace": RELEASE_NS},
                       "data": {k: base64.b64encode(p.read_bytes()).decode() for k, p in webhook_files.items()}})
        helm_cmd(helm, cluster, "install", RELEASE, str(CHART), "--namespace", RELEASE_NS,
                 "--set", f"operator.rbacMode={request.param}",
                 "--set", f"operator.watchNamespaces={{{WATCHED}}}", "--set", "operator.webhook.enabled=true",
                 "--set", "operator.webhook.tlsSecretName=operator-webhook-tls")
        manifest = helm_cmd(helm, cluster, "get", "manifest", RELEASE, "--namespace", RELEASE_NS).stdout
        # The stand-in for Service routing (no kube-proxy, no pod): the same Service name, resolved
        # by the API server to localhost, where the operator listens on a free port.
        port = free_port()
        cluster.call("DELETE", f"/api/v1/namespaces/{RELEASE_NS}/services/{SERVICE}")
        cluster.wait_gone(f"/api/v1/namespaces/{RELEASE_NS}/services/{SERVICE}")
        cluster.call("POST", f"/api/v1/namespaces/{RELEASE_NS}/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": RELEASE_NS},
            "spec": {"type": "ExternalName", "externalName": "localhost",
                     "ports": [{"name": "webhook", "port": port}]}})
        yield {"manifest": manifest, "webhook_files": {**webhook_files, "port": port}}
        helm_cmd(helm, cluster, "uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "2m")


@pytest.fixture(scope="module")
def operator(release: dict[str, Any], crds: Cluster, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:
    """The chart's operator, authenticated with its ServiceAccount's token, until the module ends."""
    import os
    import sys

    cluster = crds
    token = cluster.service_account_token(RELEASE_NS, f"{RELEASE}-operator")
    kubeconfig = cluster.kubeconfig(token, "operator-sa", WATCHED)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "inferplane.cli", "operator", *operator_args(release["manifest"],
                                                                                 release["webhook_files"])],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    running = OperatorProcess(process, log)
    try:
        # kopf registers the webhook once it serves it: from then on admission applies.
        # kopf first creates the configuration empty, then fills in the webhooks: wait for those.
        registered = running.wait_for(lambda: (cfg := cluster.get(
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/inferplane.io")) and
            cfg.get("webhooks") and cfg, TIMEOUT, "the operator's webhook registered")
        (hook,) = registered["webhooks"]
        assert hook["clientConfig"]["service"] == {"namespace": RELEASE_NS, "name": SERVICE, "path": "/validate-spec",
                                                   "port": release["webhook_files"]["port"]}
        assert "url" not in hook["clientConfig"] and hook["clientConfig"]["caBundle"]
        yield running
    finally:
        running.stop()
        # A webhook nobody serves would refuse every later write of InferenceDeployments.
        cluster.request("DELETE", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/inferplane.io")
        print(running.log()[-20000:])


def children_of(cluster: Cluster, name: str) -> dict[str, dict[str, Any] | None]:
    return {kind: cluster.get(f"{collection}/{name}") for kind, collection in CHILDREN.items()}


def status_of(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get(idep_path(WATCHED, name)) or {}).get("status") or {}


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def test_chart_minimum_is_the_release_these_tests_run_against() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    major, minor = kubernetes_version().removeprefix("v").split(".")[:2]
    assert chart["kubeVersion"] == f">={major}.{minor}.0-0"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_reconciles_into_accepted_children(crds: Cluster, operator: OperatorProcess,
                                                         example: Path) -> None:
    cluster = crds
    body = yaml.safe_load(example.read_text())
    body["metadata"]["namespace"] = WATCHED
    name = body["metadata"]["name"]
    created = cluster.apply(body, manager="kubectl")
    uid = created["metadata"]["uid"]

    children = operator.wait_for(lambda: all(children_of(cluster, name).values()) and children_of(cluster, name),
                        TIMEOUT, f"the children of {name}")
    for kind, child in children.items():
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}], kind
        managers = {(m["manager"], m["operation"]) for m in child["metadata"]["managedFields"]}
        assert ("inferplane-operator", "Apply") in managers, (kind, managers)

    status = operator.wait_for(
        lambda: status_of(cluster, name).get("observedGeneration") == 1 and status_of(cluster, name),
        TIMEOUT, f"the status of {name}")
    assert status["phase"] == "Progressing"
    assert set(conditions(status)) == {"Ready", "Progressing", "Degraded"}
    assert conditions(status)["Ready"]["status"] == "False"
    assert status["selectedRuntime"] in ("paged", "radix", "cpu-int8", "embedding")
    # The Deployment controller took the Deployment in: a ReplicaSet exists with the pod template.
    operator.wait_for(lambda: cluster.call("GET", f"/apis/apps/v1/namespaces/{WATCHED}/replicasets",
                                  params={"labelSelector": f"inferplane.io/deployment={name}"})["items"],
             TIMEOUT, f"a ReplicaSet for {name}")


def test_webhook_refuses_what_only_the_python_rules_know(crds: Cluster, operator: OperatorProcess) -> None:
    cluster = crds
    # A KV fraction means "of free GPU memory"; without a GPU it means nothing. Schema and CEL accept it.
    body = idep("nogpu", WATCHED, engine={"kvCacheMemory": "0.9"})
    _, errors = crd.validate(body)
    assert errors == []
    status, answer = cluster.request("POST", idep_path(WATCHED), body)
    assert status == 422, answer
    assert 'admission webhook "validate-spec.inferplane.io" denied the request' in answer["message"]
    assert "spec.engine.kvCacheMemory" in answer["message"] and "resources.gpus is 0" in answer["message"]
    assert cluster.get(idep_path(WATCHED, "nogpu")) is None

    # Updates are admitted too: an accepted resource cannot be patched into an invalid one.
    cluster.apply(idep("valid", WATCHED, resources={"memory": "4Gi"}))
    status, answer = cluster.request("PATCH", idep_path(WATCHED, "valid"),
                                     {"spec": {"engine": {"kvCacheMemory": "6GiB"}}},
                                     content_type="application/merge-patch+json")
    assert status == 422 and "kvCacheMemory" in answer["message"], answer
    assert "kvCacheMemory" not in (cluster.get(idep_path(WATCHED, "valid"))["spec"].get("engine") or {})


def test_kubectl_scale_reaches_the_workers_and_ready_pods_make_it_ready(
        crds: Cluster, operator: OperatorProcess, kubectl: Path) -> None:
    cluster = crds
    cluster.apply(idep("scaled", WATCHED, maxReplicas=4))
    deployments = f"/apis/apps/v1/namespaces/{WATCHED}/deployments"
    operator.wait_for(lambda: cluster.get(f"{deployments}/scaled"), TIMEOUT, "the worker Deployment")

    run_kubectl(kubectl, cluster.admin_kubeconfig, "scale", "idep/scaled", "--replicas=2", "-n", WATCHED)
    operator.wait_for(lambda: cluster.get(f"{deployments}/scaled")["spec"]["replicas"] == 2, TIMEOUT,
             "spec.replicas 2 on the worker Deployment")
    scale = cluster.call("GET", idep_path(WATCHED, "scaled") + "/scale")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == "inferplane.io/deployment=scaled"

    # The ReplicaSet controller creates the pods; with no kubelet the test reports them ready.
    selector = "inferplane.io/deployment=scaled"
    operator.wait_for(lambda: len(cluster.call("GET", f"/api/v1/namespaces/{WATCHED}/pods",
                                      params={"labelSelector": selector})["items"]) == 2, TIMEOUT, "2 worker pods")
    assert cluster.mark_pods_ready(WATCHED, selector) == 2
    status = operator.wait_for(
        lambda: status_of(cluster, "scaled").get("phase") == "Ready" and status_of(cluster, "scaled"),
        TIMEOUT, "phase Ready")
    assert status["readyReplicas"] == 2
    assert (conditions(status)["Ready"]["status"], conditions(status)["Ready"]["reason"]) == ("True", "WorkersReady")
    assert status["endpoints"] == [f"scaled.{WATCHED}.svc:50051"]
    # kubectl reads the printer columns from the CRD.
    table = run_kubectl(kubectl, cluster.admin_kubeconfig, "get", "idep", "scaled", "-n", WATCHED).stdout
    assert "scaled" in table and "smollm2-135m" in table


def test_server_side_apply_keeps_other_managers_fields_and_drops_the_operators_old_ones(
        crds: Cluster, operator: OperatorProcess) -> None:
    cluster = crds
    cluster.apply(idep("owned", WATCHED, nodeSelector={"disktype": "ssd"}))
    path = f"/apis/apps/v1/namespaces/{WATCHED}/deployments/owned"
    first = operator.wait_for(lambda: cluster.get(path), TIMEOUT, "the worker Deployment")
    assert first["spec"]["template"]["spec"]["nodeSelector"] == {"disktype": "ssd"}
    # Somebody else (a cost tool, say) owns an annotation on the operator's Deployment.
    cluster.apply({"apiVersion": "apps/v1", "kind": "Deployment",
                   "metadata": {"name": "owned", "namespace": WATCHED, "annotations": {"cost-center": "42"}}},
                  manager="cost-tool")

    # The spec drops its node selector: the operator's next apply no longer sets the field, and
    # server-side apply removes what this manager owned and stopped applying (a merge patch would
    # have left it in place).
    cluster.call("PATCH", idep_path(WATCHED, "owned"), [{"op": "remove", "path": "/spec/nodeSelector"}],
                 content_type="application/json-patch+json")
    updated = operator.wait_for(
        lambda: (d := cluster.get(path)) and "nodeSelector" not in d["spec"]["template"]["spec"] and d,
        TIMEOUT, "the Deployment without a nodeSelector")
    assert updated["metadata"]["annotations"]["cost-center"] == "42"  # not the operator's: kept
    assert updated["metadata"]["annotations"][ANNOTATION_HASH] != first["metadata"]["annotations"][ANNOTATION_HASH]
    assert updated["metadata"]["uid"] == first["metadata"]["uid"]
    managers = {m["manager"]: m for m in updated["metadata"]["managedFields"]}
    assert "f:cost-center" in str(managers["cost-tool"]["fieldsV1"])
    assert "f:cost-center" not in str(managers["inferplane-operator"]["fieldsV1"])
    assert managers["inferplane-operator"]["operation"] == "Apply"


def test_delete_runs_the_finalizer_and_the_garbage_collector_removes_the_rest(
        crds: Cluster, operator: OperatorProcess) -> None:
    cluster = crds
    cluster.apply(idep("gone", WATCHED))
    operator.wait_for(lambda: all(children_of(cluster, "gone").values()), TIMEOUT, "the children")
    operator.wait_for(lambda: "inferplane.io/finalizer" in (cluster.get(idep_path(WATCHED, "gone"))["metadata"]
                                                  .get("finalizers") or []), TIMEOUT, "the finalizer")
    replicasets = f"/apis/apps/v1/namespaces/{WATCHED}/replicasets"
    selector = {"labelSelector": "inferplane.io/deployment=gone"}
    operator.wait_for(lambda: cluster.call("GET", replicasets, params=selector)["items"], TIMEOUT, "the ReplicaSet")

    cluster.call("DELETE", idep_path(WATCHED, "gone"))
    operator.wait_for(lambda: cluster.get(idep_path(WATCHED, "gone")) is None, TIMEOUT, "the resource to go")
    assert not any(children_of(cluster, "gone").values())
    # ReplicaSets (and their pods) are the Deployment's, removed by the controller-manager's GC.
    operator.wait_for(lambda: not cluster.call("GET", replicasets, params=selector)["items"], TIMEOUT,
             "the ReplicaSet garbage-collected")


def test_the_operator_needed_every_permission_it_has_and_was_refused_none(
        crds: Cluster, operator: OperatorProcess, release: dict[str, Any]) -> None:
    """RBAC is exactly what the operator needs: nothing refused, nothing granted and never used."""
    cluster = crds
    assert cluster.forbidden_requests(OPERATOR_USER) == []
    used = set()
    for event in cluster.audit_events(OPERATOR_USER):
        ref = event.get("objectRef")
        if ref:
            used.add((ref.get("apiGroup", ""), _resource(ref), event["verb"]))
            if event["verb"] == "patch" and (event.get("responseStatus") or {}).get("code") == 201:
                # A server-side apply that created the object: the server checked `create` too.
                used.add((ref.get("apiGroup", ""), _resource(ref), "create"))
    assert used, "no audited request of the operator: is the audit log written?"
    granted = _granted(release["manifest"])
    unused = sorted(g for g in granted - used if g not in NOT_EXERCISED)
    assert unused == [], f"granted but never used by the operator in these tests: {unused}"


# Granted on purpose although no audited request of these tests uses them, and why.
NOT_EXERCISED = {
    # kopf posts Events for warnings and errors only; a green run has none.
    ("", "events", "create"),
    # Not a request: OwnerReferencesPermissionEnforcement admission checks it whenever the operator
    # writes a child whose owner reference sets blockOwnerDeletion (refused without it: 403).
    ("inferplane.io", "inferencedeployments/finalizers", "update"),
}


def _resource(ref: dict[str, Any]) -> str:
    return ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")


def _granted(manifest: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every rule of the operator's Roles and ClusterRoles."""
    granted = set()
    for doc in yaml.safe_load_all(manifest):
        if not doc or doc["kind"] not in ("Role", "ClusterRole") or "-operator" not in doc["metadata"]["name"]:
            continue
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        granted.add((group, resource, verb))
    return granted

