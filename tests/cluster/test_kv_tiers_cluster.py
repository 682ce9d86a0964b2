"""KV that follows a conversation on a real node: a deployment keeps its KV disk tier in the node's
directory (the chart's operator.kvTier.hostPath), so the conversation's next turn reads its history
back (`cached_tokens` > 0) after its pod was deleted, after a rollout, and after scale to zero and back:
each time a new pod, whose worker indexes and announces what its predecessors left on the node."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import KV_TIER, WATCHED, Platform, wait_pods_ready
from tests.cluster.workloads import (
    IDEPS,
    deploy,
    generation,
    patch_spec,
    register,
    rolled_out,
    tenant_key,
    undeploy,
    wait_served,
)
from tests.k8s.cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "chat-memory"
SELECTOR = f"app.kubernetes.io/instance={NAME}"
ENGINE = {"maxNumSeqs": 8, "kvCacheMemory": "256MiB", "kvOffloadDisk": "256MiB"}


def test_a_conversation_keeps_its_kv_through_pod_deletion_rollout_and_scale_to_zero(platform: Platform,
                                                                                     model_server: str) -> None:
    register(platform, model_server)
    key = tenant_key(platform, "memory")
    deploy(platform, NAME, "cpu-int8", engine=ENGINE, minReplicas=0, maxReplicas=1)
    history = [{"role": "system", "content": "You are a patient storyteller. " * 12},
               {"role": "user", "content": "Tell me about the lighthouse keeper and the storm."}]

    def turn(note: str) -> int:
        reply = httpx.post(f"{platform.gateway_url}/v1/chat/completions", timeout=900,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": NAME, "max_tokens": 8, "temperature": 0, "messages": history})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        history.append({"role": "user", "content": f"And then? ({note})"})
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"\n{note}: {body['usage']['prompt_tokens']} prompt tokens, {cached} cached")
        return cached

    def pod_name() -> str:
        (pod,) = wait_pods_ready(platform, WATCHED, SELECTOR, 1)
        return pod["metadata"]["name"]

    try:
        wait_served(platform, key, NAME, timeout=900)
        turn("first turn")
        assert any(KV_TIER.glob(f"{WATCHED}/{NAME}/*/*/*.kvb")), "the tier wrote to the node's directory"

        first = pod_name()
        platform.node.cluster.call("DELETE", f"/api/v1/namespaces/{WATCHED}/pods/{first}")
        wait_for(lambda: pod_name() != first, 900, "a new pod after the deletion", interval=2)
        wait_served(platform, key, NAME)  # Ready is not yet routed: the gateway lists endpoints every 2 s
        assert turn("after the pod was deleted") > 0

        before = generation(platform, NAME)
        patch_spec(platform, NAME, {"engine": {**ENGINE, "maxNumSeqs": 6}})
        wait_for(lambda: rolled_out(platform, NAME, before), 900, "the rollout", interval=2)
        wait_served(platform, key, NAME)
        assert turn("after a rollout") > 0

        patch_spec(platform, NAME, {"replicas": 0})
        wait_for(lambda: not platform.pods(WATCHED, SELECTOR), 600, "scaled to zero", interval=2)
        patch_spec(platform, NAME, {"replicas": 1})
        wait_served(platform, key, NAME, timeout=900)
        assert turn("after scale to zero and back") > 0
        assert (platform.node.cluster.get(f"{IDEPS}/{NAME}") or {}).get("spec", {}).get("replicas") == 1
    finally:
        undeploy(platform, NAME)
