"""Scale to zero and back on a real node, with a real cold start.

The gateway's autoscaler takes an idle deployment to zero replicas through the scale subresource;
the next request is held by the gateway while the operator scales the worker Deployment up, the
kubelet starts the pod (the image is on the node), the init container fetches the weights (from
the node's digest cache, or over the network when that is empty) and the worker loads. The test
prints the time from the held request to its answer in both cases.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from tests.cluster.conftest import MODEL_CACHE, Platform
from tests.cluster.workloads import IDEPS, deploy, register, start_phases, tenant_key, undeploy, wait_served
from tests.k8s.cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
AUTOSCALING = {"enabled": True, "idleSeconds": 5, "stableWindowSeconds": 6, "panicWindowSeconds": 1,
               "scaleDownDelaySeconds": 0, "queueSize": 10, "queueTimeoutSeconds": 900}


def _at_zero(platform: Platform, name: str) -> bool:
    found = platform.node.cluster.get(f"{IDEPS}/{name}") or {}
    pods = platform.pods("team-a", f"app.kubernetes.io/instance={name}")
    return found.get("spec", {}).get("replicas") == 0 and not pods


def test_a_request_to_a_deployment_at_zero_is_held_until_a_new_pod_answers(platform: Platform,
                                                                          model_server: str) -> None:
    resolved = register(platform, model_server)
    key = tenant_key(platform, "sleepy")
    name = "chat-on-demand"
    deploy(platform, name, "cpu-int8", minReplicas=0, maxReplicas=1, autoscaling=AUTOSCALING)
    try:
        wait_served(platform, key, name, timeout=900)
        assert (MODEL_CACHE / resolved["sha256"]).is_dir(), "the first pod filled the node's digest cache"
        for case in ("image and weights on the node", "image on the node, empty weights cache"):
            wait_for(lambda: _at_zero(platform, name), 300, f"{name} scaled to zero", interval=2)
            if "empty" in case:
                shutil.rmtree(MODEL_CACHE / resolved["sha256"])
            started = time.monotonic()
            reply = httpx.post(f"{platform.gateway_url}/v1/chat/completions", timeout=900,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": name, "max_tokens": 4,
                                     "messages": [{"role": "user", "content": "Hello"}]})
            elapsed = time.monotonic() - started
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
            (pod,) = platform.pods("team-a", f"app.kubernetes.io/instance={name}")
            print(f"\nscale from zero ({case}): held request answered after {elapsed:.1f} s "
                  f"({start_phases(pod)})")
            assert (MODEL_CACHE / resolved["sha256"]).is_dir()
    finally:
        undeploy(platform, name)
