"""KV that follows the conversation under `inferplane up`: a deployment with a disk tier (kv-aware
routing by default) scales to zero when idle, and the conversation's next turn, answered by the new
worker process, reads its history back from the disk tier (cached_tokens > 0) after the gateway's
index learned from that worker's KV events what it found there."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local.platform import LocalPlatform, Manifest
from tests.local.test_autoscale_local import until
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow
NAME = "memo"


async def test_a_conversation_after_scale_to_zero_reads_its_history_from_the_disk_tier(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    spec = InferenceDeploymentSpec.from_dict({
        "model": {"uri": model, "format": "safetensors"}, "runtime": "radix", "replicas": 1, "minReplicas": 0,
        "maxReplicas": 1, "resources": {"cpu": "1", "memory": "2Gi"},
        "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "kvOffloadDisk": "16MiB"},
        "autoscaling": {"enabled": True, "stableWindowSeconds": 6, "panicWindowSeconds": 2,
                        "scaleDownDelaySeconds": 0, "idleSeconds": 2, "queueTimeoutSeconds": 300}})
    port = free_port()
    platform = LocalPlatform(tmp_path / "home", [Manifest(NAME, spec)], "127.0.0.1", port, None,
                             autoscale_interval=0.25)
    await platform.start()
    try:
        assert await platform.wait_ready(300), platform.supervisor.failed_to_start()
        router = platform.gateway.router
        assert {d.routing_policy for d in router.deployments(NAME)} == {"kv-aware"}
        headers = {"authorization": f"Bearer {platform.tenant_key}"}
        prompt = " ".join(f"line {i} of the story so far;" for i in range(6))
        async with httpx.AsyncClient(timeout=300) as client:

            async def turn(text: str) -> dict:
                reply = await client.post(f"http://127.0.0.1:{port}/v1/completions", headers=headers,
                                          json={"model": NAME, "prompt": text, "max_tokens": 8, "temperature": 0})
                assert reply.status_code == 200, reply.text
                return reply.json()

            first = await turn(prompt)
            assert first["usage"]["prompt_tokens"] > 64
            replicas = platform.supervisor.deployments[NAME].replicas
            await until(lambda: not replicas, 300, "the idle deployment at zero")
            second = await turn(prompt + first["choices"][0]["text"] + " and then?")
            # The new process read the first turn's blocks from the disk tier the old one left.
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        # The gateway's index learns, from the new worker's events, where those blocks are.
        (address,) = [r.address for r in platform.supervisor.deployments[NAME].replicas]
        await until(lambda: router.kv_index.replica_blocks(address).get("disk", 0) >= 4, 120,
                    "the index converged on the new worker's disk blocks")
        assert router.decisions[("kv-aware", "ring")] + router.decisions[("kv-aware", "held")] == 2
    finally:
        await platform.stop()

