"""A disaggregated InferenceDeployment against a real API server: the operator adds the prefill pool
beside the decode pool and removes it when disaggregation is turned off (server-side apply drops
the decode pods' pool label then, which the in-memory API's merge cannot show)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.k8s.cluster import Cluster
from tests.k8s.conftest import OperatorProcess, idep, namespace

TIMEOUT = 120.0
POOL = "inferplane.io/pool"


def children(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return {
        "Deployment": cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
        "Service": cluster.get(f"/api/v1/namespaces/{ns}/services/{name}"),
        "PodDisruptionBudget": cluster.get(f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{name}"),
        "ServiceMonitor": cluster.get(f"/apis/monitoring.coreos.com/v1/namespaces/{ns}/servicemonitors/{name}"),
    }


def test_the_prefill_pool_comes_and_goes_with_disaggregation(
        crds: Cluster, start_operator: Callable[..., OperatorProcess]) -> None:
    cluster = crds
    with namespace(cluster, "disagg") as ns:
        operator = start_operator(cluster.admin_kubeconfig, "--standalone", "-n", ns, "--liveness=")
        created = cluster.apply(idep("split", ns, disaggregation={"enabled": True, "prefill": {"replicas": 2}}))
        prefill = operator.wait_for(lambda: all((found := children(cluster, ns, "split-prefill")).values()) and found,
                                    TIMEOUT, "the prefill pool's children")
        decode = operator.wait_for(lambda: all((found := children(cluster, ns, "split")).values()) and found,
                                   TIMEOUT, "the decode pool's children")
        for obj in prefill.values():
            assert obj["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        assert prefill["Deployment"]["spec"]["replicas"] == 2
        assert prefill["Deployment"]["spec"]["template"]["metadata"]["labels"][POOL] == "prefill"
        assert decode["Deployment"]["spec"]["template"]["metadata"]["labels"][POOL] == "decode"
        assert prefill["Service"]["spec"]["selector"] == {"inferplane.io/deployment": "split-prefill"}
        assert decode["Service"]["spec"]["selector"] == {"inferplane.io/deployment": "split"}
        assert "inferplane.io/served-model-name" not in prefill["Service"]["metadata"]["annotations"]

        # Turned off (the field dropped from the applied spec): the prefill pool goes, the decode
        # pool's Deployment stays, patched in place, without the pool label.
        cluster.apply(idep("split", ns))
        operator.wait_for(lambda: not any(children(cluster, ns, "split-prefill").values()), TIMEOUT,
                          "the prefill pool's children deleted")

        def unlabelled() -> Any:
            found = cluster.get(f"/apis/apps/v1/namespaces/{ns}/deployments/split")
            return POOL not in found["spec"]["template"]["metadata"]["labels"] and found
        after = operator.wait_for(unlabelled, TIMEOUT, "the decode pods' pool label dropped")
        assert after["metadata"]["uid"] == decode["Deployment"]["metadata"]["uid"]
        assert all(children(cluster, ns, "split").values())
