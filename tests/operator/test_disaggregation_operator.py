"""The real operator with a disaggregated InferenceDeployment, against the in-memory API (kmock)."""

from __future__ import annotations

from typing import Any

from tests.operator.conftest import NAMESPACE, eventually
from tests.operator.test_operator_kmock import BASE, CHILDREN, IDEPS, create, patch, resource, status_of

POOL_CHILDREN = CHILDREN[:4]  # the prefill pool has no PrometheusRule of its own
DISAGGREGATED = {"enabled": True, "prefill": {"replicas": 2, "maxReplicas": 3}}


def children_of(api: Any, name: str) -> dict[str, Any]:
    return {kind: api.get(kind, NAMESPACE, name) for kind in CHILDREN}


async def test_disaggregation_adds_the_prefill_pool_and_turning_it_off_removes_it(operator: Any) -> None:
    code, created = await create(operator, resource("split", disaggregation=DISAGGREGATED))
    assert code in (200, 201), created
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "split-prefill") for kind in POOL_CHILDREN))
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "split") for kind in CHILDREN))
    assert operator.get(CHILDREN[4], NAMESPACE, "split-prefill") is None
    prefill = operator.get("apps/v1/deployments", NAMESPACE, "split-prefill")
    assert prefill["spec"]["replicas"] == 2
    assert prefill["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert prefill["spec"]["template"]["metadata"]["labels"]["inferplane.io/pool"] == "prefill"
    decode = operator.get("apps/v1/deployments", NAMESPACE, "split")
    assert decode["spec"]["template"]["metadata"]["labels"]["inferplane.io/pool"] == "decode"
    await eventually(lambda: status_of(operator, "split").get("phase") == "Progressing")

    # The prefill pool's readiness does not make the resource Ready: its status follows the decode pool.
    code = await patch(operator, f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/split-prefill/status", {
        "status": {"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2,
                   "availableReplicas": 2}})
    assert code == 200
    assert status_of(operator, "split").get("readyReplicas", 0) == 0

    # Its replicas follow the spec's.
    assert await patch(operator, f"{BASE}/split", {"spec": {"disaggregation": {"prefill": {"replicas": 3}}}}) == 200
    await eventually(lambda: operator.get("apps/v1/deployments", NAMESPACE, "split-prefill")["spec"]["replicas"] == 3)

    # Turned off: the prefill pool's children go, the decode pool's stay (patched, not recreated).
    decode_uid = decode["metadata"]["uid"]
    assert await patch(operator, f"{BASE}/split", {"spec": {"disaggregation": {"enabled": False}}}) == 200
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "split-prefill") is None for kind in POOL_CHILDREN))
    # (The in-memory API merges applies, so the dropped pool label stays here; the real server's
    # apply drops it: tests/k8s/test_disaggregation_kube.py.) The default KV tier goes with it.
    await eventually(lambda: "--kv-offload-memory" not in operator.get(
        "apps/v1/deployments", NAMESPACE, "split")["spec"]["template"]["spec"]["containers"][0]["args"])
    assert all(children_of(operator, "split").values())
    assert operator.get("apps/v1/deployments", NAMESPACE, "split")["metadata"]["uid"] == decode_uid


async def test_the_finalizer_removes_both_pools(operator: Any) -> None:
    await create(operator, resource("both", disaggregation=DISAGGREGATED))
    await eventually(lambda: all(operator.get(kind, NAMESPACE, name) for kind in POOL_CHILDREN
                                 for name in ("both", "both-prefill")))
    await eventually(lambda: "inferplane.io/finalizer" in
                     (operator.get(IDEPS, NAMESPACE, "both")["metadata"].get("finalizers") or []))
    async with operator.clients[0].delete(f"{BASE}/both") as response:
        assert response.status == 200
    await eventually(lambda: operator.get(IDEPS, NAMESPACE, "both") is None)
    assert all(operator.get(kind, NAMESPACE, name) is None for kind in CHILDREN for name in ("both", "both-prefill"))


async def test_a_prefill_pool_never_takes_another_resources_children(operator: Any) -> None:
    """`chat` disaggregated builds `chat-prefill`: where that is another InferenceDeployment's, `chat`
    is Degraded and the other's children are left as they are."""
    await create(operator, resource("chat-prefill"))
    await eventually(lambda: all(operator.get(kind, NAMESPACE, "chat-prefill") for kind in CHILDREN))
    theirs = operator.get("apps/v1/deployments", NAMESPACE, "chat-prefill")

    await create(operator, resource("chat", disaggregation=DISAGGREGATED))
    status = await eventually(lambda: status_of(operator, "chat").get("phase") == "Degraded"
                              and status_of(operator, "chat"))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "NameTaken" and "InferenceDeployment chat-prefill" in degraded["message"]
    assert operator.get("apps/v1/deployments", NAMESPACE, "chat-prefill") == theirs
