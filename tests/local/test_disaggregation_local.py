"""Prefill/decode disaggregation under `inferplane up`: a disaggregated deployment runs its prefill
pool as processes of its own; a prompt with more uncached tokens than minPrefillTokens is computed
there and its KV pulled by the decode worker (the gateway's metric and both workers' counters say
so), a short one is computed by the decode worker alone; the answers equal a plain deployment's."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.local.platform import LocalPlatform, Manifest
from inferplane.v1 import worker_pb2, worker_pb2_grpc
from tests.local.test_autoscale_local import until
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow


async def stats(address: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
    return dict(reply.values)


async def test_a_disaggregated_deployment_runs_both_pools_as_processes(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    base = {"model": {"uri": model, "format": "safetensors"}, "runtime": "radix", "replicas": 1,
            "resources": {"cpu": "1", "memory": "2Gi"}, "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256}}
    split = InferenceDeploymentSpec.from_dict({**base, "disaggregation": {
        "enabled": True, "minPrefillTokens": 64, "prefill": {"replicas": 1}}})
    plain = InferenceDeploymentSpec.from_dict(base)
    port = free_port()
    platform = LocalPlatform(tmp_path / "home", [Manifest("split", split), Manifest("plain", plain)], "127.0.0.1",
                             port, None)
    await platform.start()
    try:
        assert await platform.wait_ready(300), platform.supervisor.failed_to_start()
        pools = platform.supervisor.deployments
        assert len(pools["split-prefill"].replicas) == 1 and len(pools["split"].replicas) == 1
        # The model is served once a decode replica is; the prefill pool may come up after it (its
        # requests' prompts are computed on the decode replica meanwhile).
        await until(lambda: pools["split-prefill"].source.endpoints(), 300, "the prefill pool serving")
        (deployment,) = platform.gateway.router.deployments("split")
        assert deployment.prefill is not None and deployment.min_prefill_tokens == 64
        headers = {"authorization": f"Bearer {platform.tenant_key}"}
        long_prompt = " ".join(f"line {i} of a long story;" for i in range(8))
        async with httpx.AsyncClient(timeout=300) as client:

            async def answer(model: str, prompt: str) -> dict:
                reply = await client.post(f"http://127.0.0.1:{port}/v1/completions", headers=headers,
                                          json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
                assert reply.status_code == 200, reply.text
                return reply.json()

            long_split, long_plain = await answer("split", long_prompt), await answer("plain", long_prompt)
            short_split, short_plain = await answer("split", "hello"), await answer("plain", "hello")
        assert long_split["usage"]["prompt_tokens"] > 64
        assert long_split["choices"][0]["text"] == long_plain["choices"][0]["text"]
        assert short_split["choices"][0]["text"] == short_plain["choices"][0]["text"]
        assert long_split["usage"]["completion_tokens"] == 12
        decode = await stats(pools["split"].replicas[0].address)
        prefill = await stats(pools["split-prefill"].replicas[0].address)
        full_blocks = long_split["usage"]["prompt_tokens"] // 16
        assert decode["kv_transfer_blocks_total:pulled"] == full_blocks
        assert prefill["kv_transfer_blocks_total:served"] == full_blocks
        outcomes = platform.gateway.context.metrics.disaggregation
        assert outcomes.labels("prefilled")._value.get() == 1
        assert outcomes.labels("decode_only")._value.get() == 1
    finally:
        await platform.stop()
