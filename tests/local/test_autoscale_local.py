"""Issue 14 on the local actuator: real worker processes (tiny model) under `LocalPlatform`.

A burst of ten times the steady load raises replicas by a panic decision and every request succeeds;
once the load stops the deployment returns to its minimum, with no failed request across the
scale-down; a deployment with minReplicas 0 goes to zero when idle, the first request after holds
until a replica is ready and succeeds, and a held request that outwaits its timeout gets a 503 with
Retry-After. No wall-clock assertions: the waits are generous deadlines, not measurements.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local.platform import LocalPlatform, Manifest
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow


def manifest(name: str, model: str, *, min_replicas: int, max_replicas: int, **autoscaling) -> Manifest:
    spec = {"model": {"uri": model, "format": "safetensors"}, "runtime": "paged",
            "resources": {"cpu": "1", "memory": "2Gi"}, "replicas": 1, "minReplicas": min_replicas,
            "maxReplicas": max_replicas, "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "maxNumSeqs": 2},
            "serving": {"servedModelName": name},
            "autoscaling": {"enabled": True, "targetQueueDepth": 1, "stableWindowSeconds": 6,
                            "panicWindowSeconds": 2, "scaleDownDelaySeconds": 3, "idleSeconds": 2, **autoscaling}}
    return Manifest(name, InferenceDeploymentSpec.from_dict(spec))


async def until(predicate, timeout: float = 180.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"gave up waiting: {what}"
        await asyncio.sleep(0.1)


class Running:
    def __init__(self, platform: LocalPlatform, port: int):
        self.platform, self.port = platform, port

    def replicas(self, name: str) -> int:
        return len(self.platform.supervisor.deployments[name].replicas)

    def ready(self, name: str) -> int:
        return sum(r.ready for r in self.platform.supervisor.deployments[name].replicas)

    async def complete(self, client: httpx.AsyncClient, model: str, max_tokens: int = 32) -> httpx.Response:
        return await client.post(f"http://127.0.0.1:{self.port}/v1/completions",
                                 headers={"authorization": f"Bearer {self.platform.tenant_key}"},
                                 json={"model": model, "prompt": "tell me a story", "max_tokens": max_tokens})


@pytest.fixture
async def platform_for(tmp_path: Path):
    started: list[LocalPlatform] = []

    async def start(*manifests: Manifest) -> Running:
        port = free_port()
        platform = LocalPlatform(tmp_path / "home", list(manifests), "127.0.0.1", port, None,
                                 autoscale_interval=0.25)
        started.append(platform)
        await platform.start()
        assert await platform.wait_ready(300), platform.supervisor.failed_to_start()
        return Running(platform, port)

    yield start
    for platform in started:
        await platform.stop()


async def test_a_burst_panics_up_and_the_quiet_after_scales_down_without_a_failure(platform_for, tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    running = await platform_for(manifest("burst", model, min_replicas=1, max_replicas=3))
    scale_ups: list[tuple[int, bool]] = []
    scaler = running.platform.autoscaler.scaler
    original = scaler.scale

    async def recording(name, replicas, decision, victims=()):
        if replicas > await scaler.current(name):
            scale_ups.append((replicas, decision.panic))
        await original(name, replicas, decision, victims)

    scaler.scale = recording
    async with httpx.AsyncClient(timeout=300) as client:
        steady = await asyncio.gather(*(running.complete(client, "burst") for _ in range(2)))
        assert {r.status_code for r in steady} == {200}
        assert running.replicas("burst") == 1
        burst = await asyncio.gather(*(running.complete(client, "burst", 120) for _ in range(20)))
        assert [r.status_code for r in burst] == [200] * 20, [r.text for r in burst if r.status_code != 200]
        assert scale_ups and scale_ups[0][1], scale_ups  # the first step up was a panic decision
        assert max(n for n, _ in scale_ups) >= 2
        await until(lambda: running.ready("burst") >= 2, what="a second replica serving")
        # The load stops; a trickle goes on while the deployment shrinks back to its minimum.
        statuses = []
        while running.replicas("burst") > 1:
            statuses.append((await running.complete(client, "burst", 4)).status_code)
        await until(lambda: running.ready("burst") == 1, what="back to one replica")
        for _ in range(5):
            statuses.append((await running.complete(client, "burst", 4)).status_code)
    assert set(statuses) == {200}, statuses
    decision = running.platform.autoscaler.targets["burst"].last
    assert decision is not None and decision.desired == 1 and not decision.panic


async def test_scale_to_zero_then_the_first_request_is_held_until_a_replica_serves(platform_for, tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    running = await platform_for(manifest("wake", model, min_replicas=0, max_replicas=2, queueTimeoutSeconds=120),
                                 manifest("impatient", model, min_replicas=0, max_replicas=1, queueTimeoutSeconds=1))
    await until(lambda: running.replicas("wake") == 0 and running.replicas("impatient") == 0,
                what="both deployments idle at zero")
    async with httpx.AsyncClient(timeout=300) as client:
        woken = await running.complete(client, "wake")
        assert woken.status_code == 200, woken.text
        assert running.ready("wake") >= 1
        refused = await running.complete(client, "impatient")
    # The replica takes longer than a second to load: the held request times out with a clear 503.
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_starting", refused.text
    assert int(refused.headers["retry-after"]) >= 1
