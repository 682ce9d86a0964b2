"""Fixtures for the tests against a real Kubernetes control plane (`tests/k8s/cluster.py`).

One control plane serves the whole session (it takes tens of seconds to start); tests keep out of
each other's way by namespace. The operator under test runs as a real `inferplane operator`
process, the way its container runs it, with the credentials it is given (mostly the chart's
ServiceAccount token).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.cluster import Cluster, install_crds, missing_binaries, running_cluster, wait_for
from tests.services import missing_service

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "inferplane"
OPERATOR_START_TIMEOUT = 120.0


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    reason = missing_binaries()
    if reason:
        missing_service(reason, hint="build them with `make envtest` (needs Go; tens of minutes the first time)")
    with running_cluster() as running:
        yield running


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> Cluster:
    """The chart's CRDs (InferenceDeployment, kopf peerings) and the Prometheus operator's two kinds."""
    install_crds(cluster)
    return cluster


def run_kubectl(kubectl: Path, kubeconfig: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(kubectl), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                            timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr or result.stdout}")
    return result


class OperatorProcess:
    """A running `inferplane operator`; its log is a file the test can read while it runs."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log_path = log

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, check: Callable[[], Any], timeout: float, what: str) -> Any:
        """wait_for() that fails at once, with the log's tail, if the operator exits meanwhile."""
        def alive_and(check: Callable[[], Any] = check) -> Any:
            if self.process.poll() is not None:
                raise AssertionError(f"the operator exited with {self.process.returncode} while waiting for "
                                     f"{what}:\n{self.log()[-6000:]}")
            return check()
        return wait_for(alive_and, timeout, what)

    def wait_for_log(self, text: str, timeout: float = OPERATOR_START_TIMEOUT) -> None:
        self.wait_for(lambda: text in self.log(), timeout, f"{text!r} in the operator's log")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture
def start_operator(tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    """Start `inferplane operator ARGS` with a kubeconfig; every one started is stopped afterwards."""
    started: list[OperatorProcess] = []

    def start(kubeconfig: Path, *args: str, name: str = "operator") -> OperatorProcess:
        log = tmp_path / f"{name}-{len(started)}.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never mistake this machine for a pod
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "inferplane.cli", "operator", *args], env=env,
                                       stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        operator = OperatorProcess(process, log)
        started.append(operator)
        return operator

    yield start
    for operator in started:
        operator.stop()


@contextmanager
def namespace(cluster: Cluster, name: str) -> Iterator[str]:
    """A namespace for one test, deleted afterwards and waited for, so that the name can be reused.

    The namespace controller removes the content; InferenceDeployments whose operator has already
    stopped would keep their finalizer forever, so it is dropped here (as an admin would).
    """
    cluster.create_namespace(name)
    wait_for(lambda: cluster.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), 60,
             f"the default ServiceAccount in {name}")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)

        def gone() -> bool:
            for item in (cluster.get(idep_path(name)) or {}).get("items") or []:
                if item["metadata"].get("finalizers"):
                    cluster.request("PATCH", idep_path(name, item["metadata"]["name"]),
                                    {"metadata": {"finalizers": None}}, content_type="application/merge-patch+json")
            return cluster.get(f"/api/v1/namespaces/{name}") is None
        wait_for(gone, 180, f"namespace {name} deleted", interval=0.5)


def idep(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"name": "smollm2-135m"}, **spec}}


def idep_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/inferplane.io/v1alpha1/namespaces/{namespace}/inferencedeployments"
    return f"{base}/{name}" if name else base
