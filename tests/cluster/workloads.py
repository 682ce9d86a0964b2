"""What the cluster tests do as a platform user: register the model, make a tenant key, apply and
remove InferenceDeployments, wait for the operator's rollouts to finish on the node."""

from __future__ import annotations

import time
from typing import Any

import openai

from tests.cluster.conftest import WATCHED, Platform, pod_ready
from tests.k8s.cluster import wait_for

MODEL = "smollm2"
WORKER_RESOURCES = {"cpu": "800m", "memory": "2Gi"}  # two fit the 2-core node: a rollout surges one
IDEPS = f"/apis/inferplane.io/v1alpha1/namespaces/{WATCHED}/inferencedeployments"


def register(platform: Platform, source: str, version: str = "1") -> dict[str, Any]:
    """The model in the registry (the control plane fetches it once to record its digest)."""
    with platform.admin() as admin:
        reply = admin.post("/admin/v1/models", json={"source": source, "name": MODEL, "version": version})
        assert reply.status_code in (201, 409), reply.text
        found = admin.get("/admin/v1/models/resolve", params={"name": MODEL, "version": version})
        assert found.status_code == 200, found.text
        return found.json()


def tenant_key(platform: Platform, tenant: str) -> str:
    with platform.admin() as admin:
        created = admin.post("/admin/v1/tenants", json={"id": tenant})
        assert created.status_code in (201, 409), created.text
        made = admin.post("/admin/v1/keys", json={"tenant_id": tenant})
        assert made.status_code == 201, made.text
        return made.json()["key"]


def idep_spec(name: str, runtime: str, **overrides: Any) -> dict[str, Any]:
    spec = {"model": {"name": MODEL}, "runtime": runtime, "replicas": 1, "resources": WORKER_RESOURCES,
            "engine": {"maxNumSeqs": 8, "kvCacheMemory": "256MiB"}, "serving": {"servedModelName": name},
            "drainGraceSeconds": 10, **overrides}
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": WATCHED}, "spec": spec}


def deploy(platform: Platform, name: str, runtime: str, **overrides: Any) -> None:
    platform.node.cluster.apply(idep_spec(name, runtime, **overrides))


def patch_spec(platform: Platform, name: str, patch: dict[str, Any]) -> None:
    platform.node.cluster.call("PATCH", f"{IDEPS}/{name}", {"spec": patch},
                               content_type="application/merge-patch+json")


def undeploy(platform: Platform, name: str) -> None:
    cluster = platform.node.cluster
    cluster.request("DELETE", f"{IDEPS}/{name}")
    cluster.wait_gone(f"{IDEPS}/{name}", timeout=300)
    wait_for(lambda: not platform.pods(WATCHED, f"app.kubernetes.io/instance={name}"), 300,
             f"{name}'s pods gone", interval=2)


def rolled_out(platform: Platform, name: str, since_generation: int) -> bool:
    """The worker Deployment moved past `since_generation` and only its new pods remain, all Ready."""
    found = platform.node.cluster.get(f"/apis/apps/v1/namespaces/{WATCHED}/deployments/{name}") or {}
    meta, spec, status = found.get("metadata", {}), found.get("spec", {}), found.get("status", {})
    if meta.get("generation", 0) <= since_generation or status.get("observedGeneration", 0) < meta["generation"]:
        return False
    want = spec.get("replicas", 0)
    if not (status.get("updatedReplicas", 0) == status.get("replicas", 0) == status.get("readyReplicas", 0) == want):
        return False
    pods = platform.pods(WATCHED, f"app.kubernetes.io/instance={name}")
    return len(pods) == want and all(pod_ready(p) and not p["metadata"].get("deletionTimestamp") for p in pods)


def generation(platform: Platform, name: str) -> int:
    found = platform.node.cluster.get(f"/apis/apps/v1/namespaces/{WATCHED}/deployments/{name}") or {}
    return found.get("metadata", {}).get("generation", 0)


def wait_served(platform: Platform, key: str, name: str, timeout: float = 240) -> None:
    """The gateway lists `name` and one request is answered (its endpoints come from the EndpointSlice)."""
    client = openai.OpenAI(base_url=f"{platform.gateway_url}/v1", api_key=key, max_retries=0, timeout=300)

    def listed() -> bool:
        try:
            return any(m.id == name for m in client.models.list())
        except openai.APIConnectionError:  # a gateway pod just replaced: its Service may not route to it yet
            return False
    wait_for(listed, timeout, f"{name} listed by the gateway")

    def answers() -> bool:
        try:
            client.chat.completions.create(model=name, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        except openai.APIConnectionError:
            return False
        except openai.APIStatusError as error:
            if error.status_code in (404, 503):
                return False
            raise
        return True
    wait_for(answers, timeout, f"a first answer from {name}", interval=2)


def timed(what: str, started: float) -> float:
    seconds = time.monotonic() - started
    print(f"\n{what}: {seconds:.0f} s")
    return seconds


def start_phases(pod: dict[str, Any]) -> str:
    """Where a pod's start went, from its status times (1 s resolution): scheduling, the init
    container (fetch-model), and the worker from its start to Ready (loading, the start-up gate)."""
    from datetime import datetime

    def at(stamp: str | None) -> datetime | None:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None

    status = pod.get("status") or {}
    conditions = {c["type"]: at(c.get("lastTransitionTime")) for c in status.get("conditions") or []}
    created = at(pod["metadata"].get("creationTimestamp"))
    init = next(iter(status.get("initContainerStatuses") or []), {}).get("state", {}).get("terminated", {})
    worker = next((s for s in status.get("containerStatuses") or [] if s["name"] == "worker"), {})
    running = at((worker.get("state", {}).get("running") or {}).get("startedAt"))
    parts = []
    if created and conditions.get("PodScheduled"):
        parts.append(f"scheduled {(conditions['PodScheduled'] - created).total_seconds():.0f} s")
    if init.get("startedAt") and init.get("finishedAt"):
        parts.append(f"fetch-model {(at(init['finishedAt']) - at(init['startedAt'])).total_seconds():.0f} s")
    if running and conditions.get("Ready"):
        parts.append(f"worker start to Ready {(conditions['Ready'] - running).total_seconds():.0f} s")
    return ", ".join(parts)
