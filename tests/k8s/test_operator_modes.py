"""`inferplane operator` started by hand, outside the chart: standalone, and peered without a peering.

Both were broken against a real server: `--standalone` still made kopf wait for a peering object,
and a peered operator without one waited in silence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.k8s.cluster import Cluster, wait_for
from tests.k8s.conftest import OperatorProcess, idep, idep_path, namespace

TIMEOUT = 120.0


def deployment(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    return cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}")


def test_standalone_reconciles_without_a_peering_and_children_are_garbage_collected(
        crds: Cluster, start_operator: Callable[..., OperatorProcess]) -> None:
    cluster = crds
    with namespace(cluster, "solo") as ns:
        assert cluster.get(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings/inferplane") is None
        operator = start_operator(cluster.admin_kubeconfig, "--standalone", "-n", ns, "--liveness=")
        created = cluster.apply(idep("alone", ns))
        operator.wait_for(lambda: deployment(cluster, ns, "alone"), TIMEOUT, "the worker Deployment")
        operator.wait_for(lambda: ((cluster.get(idep_path(ns, "alone")) or {}).get("status") or {}).get("phase"),
                 TIMEOUT, "a status phase")
        assert "is missing" not in operator.log()

        # Without the operator, owner references alone must clean up: stop it, let the resource go
        # without its finalizer, and the controller-manager's garbage collector deletes the children.
        operator.stop()
        cluster.call("PATCH", idep_path(ns, "alone"), {"metadata": {"finalizers": None}},
                     content_type="application/merge-patch+json")
        cluster.call("DELETE", idep_path(ns, "alone"))
        wait_for(lambda: cluster.get(idep_path(ns, "alone")) is None, TIMEOUT, "the resource to go")
        children = [f"/apis/apps/v1/namespaces/{ns}/deployments/alone", f"/api/v1/namespaces/{ns}/services/alone",
                    f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/alone",
                    f"/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors/alone",
                    f"/apis/monitoring.coreos.com/v1/namespaces/{ns}/prometheusrules/alone"]
        wait_for(lambda: all(cluster.get(path) is None for path in children), TIMEOUT,
                 f"garbage collection of the children of {created['metadata']['uid']}")


def test_peered_operator_says_what_is_missing_and_resumes_once_it_exists(
        crds: Cluster, start_operator: Callable[..., OperatorProcess]) -> None:
    cluster = crds
    with namespace(cluster, "peerless") as ns:
        operator = start_operator(cluster.admin_kubeconfig, "-n", ns, "--peering=lonely", "--liveness=")
        operator.wait_for_log("kopf peering 'lonely' is missing (KopfPeering peerless/lonely)")
        log = operator.log()
        assert "reconciles nothing until it exists" in log
        assert "kubectl create -n peerless -f - <<< '{\"apiVersion\": \"kopf.dev/v1\", \"kind\": \"KopfPeering\", " \
               "\"metadata\": {\"name\": \"lonely\"}}'" in log
        assert "inferplane operator --standalone" in log

        cluster.apply(idep("waiting", ns))
        time.sleep(5)  # paused: nothing may happen (a slow machine only makes this easier to pass)
        assert deployment(cluster, ns, "waiting") is None

        # The command from the log, as a user would paste it.
        cluster.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "lonely",
                                                                                      "namespace": ns}})
        operator.wait_for(lambda: deployment(cluster, ns, "waiting"), TIMEOUT * 2, "the Deployment once peered")
