"""The operator's watches across an API server restart (what a control-plane upgrade does to them).

Every connection breaks; the restarted server's watch cache starts at etcd's current revision, so a
watch resumed from an older resourceVersion may be answered 410 Gone and must re-list. Whatever
path kopf takes, resources created or changed after the restart must still be reconciled.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.k8s.cluster import Cluster
from tests.k8s.conftest import OperatorProcess, idep, idep_path, namespace

TIMEOUT = 180.0


def test_reconciling_goes_on_after_the_api_server_restarts(
        crds: Cluster, start_operator: Callable[..., OperatorProcess]) -> None:
    cluster = crds
    with namespace(cluster, "restart") as ns:
        deployments = f"/apis/apps/v1/namespaces/{ns}/deployments"
        operator = start_operator(cluster.admin_kubeconfig, "--standalone", "-n", ns, "--liveness=")
        cluster.apply(idep("before", ns, maxReplicas=3))
        operator.wait_for(lambda: cluster.get(f"{deployments}/before"), TIMEOUT, "the Deployment of 'before'")

        cluster.restart_apiserver()

        cluster.apply(idep("after", ns))
        operator.wait_for(lambda: cluster.get(f"{deployments}/after"), TIMEOUT, "the Deployment of 'after'")
        cluster.call("PATCH", idep_path(ns, "before") + "/scale", {"spec": {"replicas": 3}},
                     content_type="application/merge-patch+json")
        operator.wait_for(lambda: cluster.get(f"{deployments}/before")["spec"]["replicas"] == 3, TIMEOUT,
                          "the scale change made after the restart")
