"""Rollouts on a real node while a client keeps asking: none of its requests may fail.

Each change rolls the worker Deployment (maxSurge 1, maxUnavailable 0): the new pod fetches the
weights, loads and passes its probes; only then is the old one taken out, and it stops taking new
requests (preStop, the gateway drops it from its endpoints) before it drains what it has. The
changes are the ones users make: a new model version, an engine setting, and the runtime itself
(paged to radix: "switch the runtime without the clients noticing"); a last one rolls while the
operator's own pod is deleted and replaced. The test prints how long each rollout took and how
many requests went through meanwhile.
"""

from __future__ import annotations

import time

import pytest

from tests.cluster.conftest import RELEASE_NS, Platform, wait_pods_ready
from tests.cluster.traffic import Traffic
from tests.cluster.workloads import (
    deploy,
    generation,
    patch_spec,
    register,
    rolled_out,
    tenant_key,
    timed,
    undeploy,
    wait_served,
)
from tests.k8s.cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
ROLLOUT_TIMEOUT = 900.0


def test_three_rollouts_under_steady_traffic_fail_no_request(platform: Platform, model_server: str) -> None:
    register(platform, model_server, version="1")
    register(platform, model_server, version="2")
    key = tenant_key(platform, "steady")
    name = "chat-rolling"
    deploy(platform, name, "paged", model={"name": "smollm2", "version": "1"})
    try:
        wait_served(platform, key, name, timeout=900)
        changes = [
            ("a new model version (1 -> 2)", {"model": {"name": "smollm2", "version": "2"}}),
            ("an engine setting (maxNumSeqs 8 -> 6)", {"engine": {"maxNumSeqs": 6, "kvCacheMemory": "256MiB"}}),
            ("the runtime (paged -> radix)", {"runtime": "radix"}),
            ("maxNumSeqs 6 -> 4 with the operator restarted mid-rollout",
             {"engine": {"maxNumSeqs": 4, "kvCacheMemory": "256MiB"}}),
        ]
        with Traffic(platform.gateway_url, key, name) as traffic:
            traffic.wait_for_successes(3)
            for what, patch in changes:
                before, answered = generation(platform, name), traffic.succeeded
                started = time.monotonic()
                patch_spec(platform, name, patch)
                if "operator restarted" in what:
                    _restart_operator_once_the_rollout_started(platform, name, before)
                wait_for(lambda before=before: rolled_out(platform, name, before), ROLLOUT_TIMEOUT,
                         f"the rollout of {what}", interval=1)
                timed(f"rollout of {what}: {traffic.succeeded - answered} answers meanwhile", started)
                traffic.wait_for_successes(2)  # served by the new pod
        print(f"\nsteady traffic: {traffic.succeeded} answered, {len(traffic.failures)} failed")
        assert traffic.failures == [], traffic.failures[:10]
        assert traffic.succeeded >= 10
        wait_pods_ready(platform, RELEASE_NS, "app.kubernetes.io/component=operator", 1)
        pods = platform.pods("team-a", f"app.kubernetes.io/instance={name}")
        assert [p["metadata"]["labels"]["inferplane.io/runtime"] for p in pods] == ["radix"]
        assert {p["metadata"]["annotations"]["inferplane.io/model-version"] for p in pods} == {"2"}
    finally:
        undeploy(platform, name)


def _restart_operator_once_the_rollout_started(platform: Platform, name: str, before: int) -> None:
    """Delete the operator's pod after it wrote the new worker template, while pods still roll."""
    wait_for(lambda: generation(platform, name) > before, 120, "the operator writing the new template")
    (operator,) = platform.pods(RELEASE_NS, "app.kubernetes.io/component=operator")
    platform.node.cluster.call("DELETE", f"/api/v1/namespaces/{RELEASE_NS}/pods/{operator['metadata']['name']}")
