"""Faults on a real node, with two worker replicas serving and a client that keeps asking.

- A worker container killed (SIGKILL, from the node) mid-stream: its streams go on, on the other
  replica, after the tokens they had (the gateway migrates them), with no error event, hang or cut
  connection; new requests go to the other replica; the kubelet restarts the container and it
  comes back Ready.
- A worker pod deleted: it stops taking requests, finishes its streams (within its
  `drainGraceSeconds`), and is replaced.
- The gateway pod deleted while streams run: they finish (the gateway drains on SIGTERM).
- `kubectl drain` of the node: the PodDisruptionBudget lets one worker go at a time, so one
  replica keeps serving while the node is drained, and the streams the evicted pod had finish.

Every stream that finishes was billed each of its tokens once (usage), however often it moved.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.conftest import RELEASE_NS, WATCHED, Platform, kubectl_on, pod_ready, wait_pods_ready
from tests.cluster.node import NODE_NAME
from tests.cluster.traffic import Traffic
from tests.cluster.workloads import deploy, register, tenant_key, undeploy, wait_served
from tests.k8s.cluster import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
NAME = "chat-faults"
SELECTOR = f"app.kubernetes.io/instance={NAME}"


@pytest.fixture(scope="module")
def two_replicas(platform: Platform, model_server: str) -> Iterator[str]:
    """A two-replica deployment, Ready and served; its tenant key."""
    register(platform, model_server)
    key = tenant_key(platform, "faults")
    # Streams of 120 tokens on a 0.8-CPU worker take about half a minute: the drain must allow it.
    deploy(platform, NAME, "paged", replicas=2, drainGraceSeconds=90)
    try:
        wait_pods_ready(platform, WATCHED, SELECTOR, 2)
        wait_served(platform, key, NAME)
        yield key
    finally:
        undeploy(platform, NAME)


class Stream(threading.Thread):
    """One streamed completion read to its end; `outcome` is 'done', 'error: ...' or 'broken: ...'."""

    def __init__(self, platform: Platform, key: str, max_tokens: int = 120) -> None:
        super().__init__(daemon=True)
        self.platform, self.key, self.max_tokens = platform, key, max_tokens
        self.outcome = ""
        self.tokens = 0
        self.usage: dict[str, Any] = {}
        self.first_token = threading.Event()

    def run(self) -> None:
        body = {"model": NAME, "max_tokens": self.max_tokens, "stream": True, "temperature": 0.8, "seed": 1,
                "min_tokens": self.max_tokens, "messages": [{"role": "user", "content": "Tell a long story."}],
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.platform.gateway_url}/v1/chat/completions", json=body, timeout=600,
                              headers={"Authorization": f"Bearer {self.key}"}) as reply:
                if reply.status_code != 200:
                    self.outcome = f"error: HTTP {reply.status_code}"
                    self.first_token.set()
                    return
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        self.outcome = self.outcome or "done"
                        return
                    if line.startswith("data: "):
                        chunk: dict[str, Any] = json.loads(line[6:])
                        self.usage = chunk.get("usage") or self.usage
                        if "error" in chunk:
                            self.outcome = f"error: {chunk['error']}"
                        elif chunk.get("choices"):
                            self.tokens += 1
                            self.first_token.set()
            self.outcome = self.outcome or "broken: the stream ended without [DONE]"
        except httpx.HTTPError as error:
            self.outcome = f"broken: {type(error).__name__}: {error}"
        finally:
            self.first_token.set()


def _streams(platform: Platform, key: str, count: int, max_tokens: int = 120) -> list[Stream]:
    streams = [Stream(platform, key, max_tokens) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(300), "no first token"
    return streams


def _finish(streams: list[Stream]) -> list[str]:
    """Each stream's outcome, once all ended; a stream that ended well was billed each token once
    (min_tokens = max_tokens: exactly that many, however often it moved)."""
    for stream in streams:
        stream.join(timeout=600)
        assert not stream.is_alive(), "a stream hung"
    for stream in streams:
        if stream.outcome == "done":
            assert stream.usage.get("completion_tokens") == stream.max_tokens, stream.usage
    return [s.outcome for s in streams]


def _container_pid(platform: Platform, pod: dict[str, Any]) -> int:
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "worker"]
    container_id = status["containerID"].removeprefix("containerd://")
    for line in platform.node.ctr("tasks", "list").stdout.splitlines()[1:]:
        task, pid, *_ = line.split()
        if task == container_id:
            return int(pid)
    raise AssertionError(f"no containerd task for {container_id}")


def test_a_worker_killed_mid_stream_has_its_streams_finished_elsewhere_and_traffic_moves_on(
        platform: Platform, two_replicas: str) -> None:
    key = two_replicas
    victim = wait_pods_ready(platform, WATCHED, SELECTOR, 2)[0]
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    streams = _streams(platform, key, 4)
    os.kill(_container_pid(platform, victim), signal.SIGKILL)
    outcomes = _finish(streams)
    print(f"\nstreams when a worker was killed: {outcomes}")
    assert all(o == "done" for o in outcomes), outcomes
    with Traffic(platform.gateway_url, key, NAME, max_requests=30) as traffic:
        traffic.wait_for_successes(20)
    assert traffic.failures == [], traffic.failures[:5]

    def restarted() -> bool:
        pods = {p["metadata"]["name"]: p for p in platform.pods(WATCHED, SELECTOR)}
        pod = pods.get(victim["metadata"]["name"])
        return bool(pod) and pod_ready(pod) and pod["status"]["containerStatuses"][0]["restartCount"] > restarts
    wait_for(restarted, 600, "the killed worker restarted by the kubelet and Ready again", interval=2)


def test_a_deleted_worker_pod_finishes_its_streams_and_is_replaced(platform: Platform, two_replicas: str) -> None:
    key = two_replicas
    pods = wait_pods_ready(platform, WATCHED, SELECTOR, 2)
    with Traffic(platform.gateway_url, key, NAME) as traffic:
        streams = _streams(platform, key, 4)
        platform.node.cluster.call("DELETE", f"/api/v1/namespaces/{WATCHED}/pods/{pods[0]['metadata']['name']}")
        outcomes = _finish(streams)
        replaced = wait_pods_ready(platform, WATCHED, SELECTOR, 2)
        traffic.wait_for_successes(3)
    assert outcomes == ["done"] * 4, outcomes
    assert pods[0]["metadata"]["name"] not in {p["metadata"]["name"] for p in replaced}
    assert traffic.failures == [], traffic.failures[:5]


def test_the_gateway_pod_drains_its_streams_when_deleted(platform: Platform, two_replicas: str) -> None:
    key = two_replicas
    (gateway,) = wait_pods_ready(platform, RELEASE_NS, "app.kubernetes.io/component=control-plane", 1)
    # Short enough to finish within the drain (preStop 5 s + drainGraceSeconds 10 s) on a busy node.
    streams = _streams(platform, key, 3, max_tokens=40)
    platform.node.cluster.call("DELETE", f"/api/v1/namespaces/{RELEASE_NS}/pods/{gateway['metadata']['name']}")
    outcomes = _finish(streams)
    assert outcomes == ["done"] * 3, outcomes
    (replacement,) = wait_pods_ready(platform, RELEASE_NS, "app.kubernetes.io/component=control-plane", 1)
    assert replacement["metadata"]["name"] != gateway["metadata"]["name"]
    wait_served(platform, key, NAME)


def test_a_node_drain_keeps_one_replica_serving_by_the_disruption_budget(platform: Platform, two_replicas: str,
                                                                       kubectl) -> None:
    key = two_replicas
    wait_pods_ready(platform, WATCHED, SELECTOR, 2)
    with Traffic(platform.gateway_url, key, NAME) as traffic:
        traffic.wait_for_successes(2)
        streams = _streams(platform, key, 2)  # in flight when the drain evicts their pod: they finish
        try:
            drained = kubectl_on(platform.node, kubectl, "drain", NODE_NAME, f"--pod-selector={SELECTOR}",
                                 "--delete-emptydir-data", "--ignore-daemonsets", "--timeout=90s", check=False)
            # One pod is evicted; its replacement cannot schedule on the cordoned node, so the
            # budget (maxUnavailable 1) refuses the second eviction until the drain gives up.
            assert drained.returncode != 0, drained.stdout
            assert "disruption budget" in (drained.stdout + drained.stderr), drained.stderr
            pods = platform.pods(WATCHED, SELECTOR)
            assert sum(pod_ready(p) for p in pods) == 1, [p["status"].get("phase") for p in pods]
            traffic.wait_for_successes(3)
        finally:
            kubectl_on(platform.node, kubectl, "uncordon", NODE_NAME)
        wait_pods_ready(platform, WATCHED, SELECTOR, 2)
    assert _finish(streams) == ["done"] * 2
    assert traffic.failures == [], traffic.failures[:5]
