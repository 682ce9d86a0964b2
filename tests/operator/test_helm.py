"""The chart, checked by a real helm binary (3.19) and validated offline against Kubernetes 1.34 schemas."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.operator import crd
from tests.operator.conftest import ROOT

CHART = ROOT / "helm" / "inferplane"
MATRIX = {"default": None, **{p.name.removesuffix("-values.yaml"): p for p in sorted((CHART / "ci").glob("*.yaml"))}}
K8S_VERSION = "1.34.0"  # the chart's minimum (Chart.yaml kubeVersion)
# CRDs from other projects: checked structurally
THIRD_PARTY = {"monitoring.coreos.com/v1", "monitoring.coreos.com/v1alpha1", "kopf.dev/v1"}


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def render(helm: Path, values: Path | None, *extra: str) -> list[dict[str, Any]]:
    args = ["template", "demo", str(CHART), "--namespace", "inference", *extra]
    if values is not None:
        args += ["-f", str(values)]
    result = helm_run(helm, *args)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("name", MATRIX)
def test_lint_strict_is_clean(helm: Path, name: str) -> None:
    args = ["lint", "--strict", str(CHART)] + (["-f", str(MATRIX[name])] if MATRIX[name] else [])
    result = helm_run(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("name", MATRIX)
def test_rendered_objects_validate_strictly(helm: Path, name: str) -> None:
    docs = render(helm, MATRIX[name])
    assert docs
    for doc in docs:
        if doc["apiVersion"] == "inferplane.io/v1alpha1":
            _, errors = crd.validate(doc)
            assert errors == [], (doc["metadata"]["name"], errors)
        elif doc["apiVersion"] in THIRD_PARTY:
            assert doc["metadata"]["name"] and "spec" in doc or doc["kind"].endswith("KopfPeering")
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        found.setdefault(doc["kind"], []).append(doc)
    return found


def test_default_install_is_namespaced_least_privilege(helm: Path) -> None:
    found = kinds(render(helm, None))
    (role,) = [r for r in found["Role"] if r["metadata"]["name"].endswith("-operator")]
    assert role["metadata"]["namespace"] == "inference"
    cluster_rules = [r for c in found["ClusterRole"] for r in c["rules"]]
    # Cluster-wide, the operator may only read CRDs and namespaces (kopf needs both).
    assert {g for r in cluster_rules for g in r["apiGroups"]} == {"apiextensions.k8s.io", ""}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_rules)
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in role["rules"])
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-operator"))
    assert "--namespace=inference" in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    # spec.model.name resolves through the control plane's registry with the bootstrap key.
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--registry-url=http://demo-inferplane-gateway.inference.svc:8000",
            "--registry-token-file=/etc/inferplane/registry/bootstrap-key"} <= set(args), args
    registry_auth = next(v for v in operator["spec"]["template"]["spec"]["volumes"] if v["name"] == "registry-auth")
    assert registry_auth["secret"]["items"] == [{"key": "bootstrap-key", "path": "bootstrap-key"}]
    dashboards = found["ConfigMap"][0]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name, text in dashboards["data"].items():
        assert json.loads(text)["panels"], name


def test_a_shared_model_cache_and_s3_credentials_reach_the_operator(helm: Path) -> None:
    found = kinds(render(helm, None, "--set", "operator.modelCache.hostPath=/var/cache/inferplane",
                         "--set", "operator.modelStorage.secretName=s3-creds",
                         "--set", "operator.modelStorage.s3EndpointUrl=http://minio:9000"))
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-operator"))
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--model-cache-host-path=/var/cache/inferplane", "--model-storage-secret=s3-creds",
            "--s3-endpoint-url=http://minio:9000"} <= set(args)
    control = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-control-plane"))
    container = control["spec"]["template"]["spec"]["containers"][0]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]  # registering fetches once
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"} in container["env"]


def test_cluster_mode_and_ha_postgres(helm: Path) -> None:
    found = kinds(render(helm, MATRIX["ha-postgres"]))
    assert "Role" not in found or all(not r["metadata"]["name"].endswith("-operator") for r in found["Role"])
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-operator"))
    assert "--all-namespaces" in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert operator["spec"]["replicas"] == 2 and found["ClusterKopfPeering"]
    control = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-control-plane"))
    assert control["spec"]["replicas"] == 3
    env = {e["name"]: e for e in control["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["INFERPLANE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "inferplane-db", "key": "url"}
    assert env["INFERPLANE_RATE_LIMIT_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "inferplane-redis",
                                                                                   "key": "url"}
    assert "--rate-limit-unreachable=closed" in control["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "Secret" not in found and "PersistentVolumeClaim" not in found  # the URL comes from the user's Secret
    assert found["PodDisruptionBudget"]
    args = control["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--jwt-algorithm=RS256", "--jwt-key-file=/etc/inferplane/auth/jwt-key",
            "--jwt-audience=inferplane-admin"} <= set(args)
    auth = next(v for v in control["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth")
    assert auth["secret"]["secretName"] == "inferplane-gateway-auth"


def _gateway_auth_files(control: dict[str, Any]) -> dict[str, str]:
    """--flag-file=PATH arguments of the gateway container, with the mount that PATH lies in."""
    container = control["spec"]["template"]["spec"]["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "auth"]
    files = dict(a.removeprefix("--").split("=", 1) for a in container["args"] if "-file=" in a)
    assert all(path.startswith(mount["mountPath"] + "/") for path in files.values()) and mount["readOnly"]
    return files


def test_gateway_gets_a_bootstrap_key_and_one_salt_for_all_replicas(helm: Path) -> None:
    found = kinds(render(helm, None))
    control = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-control-plane"))
    files = _gateway_auth_files(control)
    assert set(files) == {"bootstrap-key-file", "salt-secret-file"}  # no JWTs unless asked for
    container = control["spec"]["template"]["spec"]["containers"][0]
    assert "INFERPLANE_RATE_LIMIT_REDIS_URL" not in {e["name"] for e in container["env"]}  # one replica: in-process
    assert "--rate-limit-unreachable=open" in container["args"]
    (secret,) = [s for s in found["Secret"] if s["metadata"]["name"].endswith("-gateway-auth")]
    volume = next(v for v in control["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for flag, key in (("bootstrap-key-file", "bootstrap-key"), ("salt-secret-file", "salt")):
        assert files[flag].endswith("/" + key)
        assert len(base64.b64decode(secret["data"][key])) >= 32


def test_network_policy_admits_only_the_gateway_to_workers(helm: Path) -> None:
    (policy,) = [p for p in kinds(render(helm, None))["NetworkPolicy"] if p["metadata"]["name"].endswith("-workers")]
    grpc = next(rule for rule in policy["spec"]["ingress"] if rule["ports"][0]["port"] == 50051)
    (peer,) = grpc["from"]
    assert peer["podSelector"]["matchLabels"] == {"inferplane.io/gateway": "true"}
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"


def test_models_from_values_are_valid_inference_deployments(helm: Path) -> None:
    found = kinds(render(helm, MATRIX["gpu"]))
    assert {d["metadata"]["name"] for d in found["InferenceDeployment"]} == {"chat", "agent"}
    operator = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-operator"))
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-port=9443" in args and "--webhook-service=inference/demo-inferplane-operator" in args


@pytest.mark.parametrize(("values", "message"), [
    (["--set", "controlPlane.replicas=3"], "needs controlPlane.database.type=postgresql"),
    (["--set", "operator.rbacMode=everything"], "rbacMode"),
    (["--set", "operator.webhook.enabled=true"], "tlsSecretName is required"),
    (["--set", "controlPlane.auth.jwtAlgorithm=HS256"], "needs controlPlane.auth.existingSecret"),
    (["--set", "controlPlane.auth.jwtAlgorithm=none"], "jwtAlgorithm"),
])
def test_invalid_values_fail_with_a_reason(helm: Path, values: list[str], message: str) -> None:
    result = helm_run(helm, "template", "demo", str(CHART), *values)
    assert result.returncode != 0
    assert message in result.stderr


def test_the_gateways_outbound_allow_list_comes_from_values(helm: Path) -> None:
    def gateway_args(*extra: str) -> list[str]:
        found = kinds(render(helm, None, *extra))
        control = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-control-plane"))
        return control["spec"]["template"]["spec"]["containers"][0]["args"]

    assert not any(a.startswith("--outbound-allow") for a in gateway_args())  # public addresses only
    allowed = gateway_args("--set-json", 'controlPlane.outboundAllow=["10.20.0.0/16","*.corp.example"]')
    assert [a for a in allowed if a.startswith("--outbound-allow")] == [
        "--outbound-allow=10.20.0.0/16", "--outbound-allow=*.corp.example"]
    refused = helm_run(helm, "template", "demo", str(CHART), "--set-json", 'controlPlane.outboundAllow=["a b"]')
    assert refused.returncode != 0 and "outboundAllow" in refused.stderr


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer"])
def test_the_gateways_metrics_have_their_own_port_service_and_policy(helm: Path, service_type: str) -> None:
    """Issue 53: the gateway's /metrics (tenants, key ids, private adapters) is scraped on its own
    port through a ClusterIP Service of its own, which only the monitoring namespace may reach; the
    API Service (a LoadBalancer, maybe) has no metrics port."""
    found = kinds(render(helm, None, "--set", f"controlPlane.service.type={service_type}"))
    control = next(d for d in found["Deployment"] if d["metadata"]["name"].endswith("-control-plane"))
    container = control["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-port=9090" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "metrics": 9090}
    services = {s["metadata"]["name"]: s for s in found["Service"]}
    api, metrics = services["demo-inferplane-gateway"], services["demo-inferplane-gateway-metrics"]
    assert [p["name"] for p in api["spec"]["ports"]] == ["http"] and api["spec"]["type"] == service_type
    assert [(p["name"], p["targetPort"]) for p in metrics["spec"]["ports"]] == [("metrics", "metrics")]
    assert metrics["spec"]["type"] == "ClusterIP"
    (monitor,) = [m for m in found["ServiceMonitor"] if m["metadata"]["name"].endswith("-gateway")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert [s["metadata"]["name"] for s in found["Service"] if _matches(selector, s["metadata"]["labels"])] == [
        "demo-inferplane-gateway-metrics"]
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("metrics", "/metrics")]

    (policy,) = [p for p in found["NetworkPolicy"] if p["metadata"]["name"].endswith("-control-plane")]
    assert _matches(policy["spec"]["podSelector"]["matchLabels"], control["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert set(by_port) == {8000, 9090}
    assert "from" not in by_port[8000]  # the API: tenants, the operator, Alertmanager
    (peer,) = by_port[9090]["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    refused = helm_run(helm, "template", "demo", str(CHART), "--set", "controlPlane.metricsPort=8000")
    assert refused.returncode != 0 and "metricsPort" in refused.stderr


def test_network_policy_lets_decode_workers_pull_kv_from_prefill_workers(helm: Path) -> None:
    """Prefill/decode disaggregation: a decode worker pulls a prompt's KV from the prefill worker over
    gRPC. Only prefill pods accept it, from decode pods of their namespace, on the gRPC port alone."""
    from inferplane.operator.manifests import GRPC_PORT, LABEL_POOL, POOL_DECODE, POOL_PREFILL

    policies = kinds(render(helm, None))["NetworkPolicy"]
    (policy,) = [p for p in policies if p["metadata"]["name"].endswith("-kv-transfer")]
    target = policy["spec"]["podSelector"]["matchLabels"]
    assert target[LABEL_POOL] == POOL_PREFILL and target["app.kubernetes.io/component"] == "worker"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": GRPC_PORT, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: the policy's own namespace only
    assert peer["podSelector"]["matchLabels"][LABEL_POOL] == POOL_DECODE
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    # The operator's pods are what the policy names: its prefill pods are the target, its decode pods the peers.
    from inferplane.api.deployment import InferenceDeploymentSpec
    from inferplane.operator.manifests import children

    spec = {"model": {"name": "m"}, "disaggregation": {"enabled": True}}
    body = {"metadata": {"name": "chat", "namespace": "inference", "uid": "u"}, "spec": spec}
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in children(body, InferenceDeploymentSpec.from_dict(spec)) if d["kind"] == "Deployment"}
    assert _matches(target, pods["chat-prefill"]) and not _matches(target, pods["chat"])
    assert _matches(peer["podSelector"]["matchLabels"], pods["chat"])
    assert not _matches(peer["podSelector"]["matchLabels"], pods["chat-prefill"])
