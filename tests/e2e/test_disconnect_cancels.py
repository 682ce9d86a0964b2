"""A client that walks away from a completion cancels it (issue 13, item 1): REST without streaming,
and the tenant gRPC API (server-streaming) whose client gives up at its deadline.

One tiny worker running one sequence at a time, so that requests queue behind each other; four
non-streaming completions whose clients give up long before the work could be done. Without
cancellation the worker would run all four to `max_tokens` for nobody. The check is what the
worker says it did: its metrics count requests that finished with reason "abort", and it becomes
idle without generating four requests' worth of tokens.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from inferplane.bench.gateway_harness import SERVED_MODEL, free_port
from inferplane.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow

REQUESTS = 4
MAX_TOKENS = 200


def _metric(text: str, finish_reason: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("inferplane_worker_requests_total{") and f'finish_reason="{finish_reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _abandon(base_url: str, key: str) -> None:
    """Send the requests and close each connection after a short wait, as an impatient client does."""
    body = {"model": SERVED_MODEL, "prompt": "tell me a long story", "max_tokens": MAX_TOKENS, "temperature": 0}

    async def one() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(0.3)) as client:
            try:
                reply = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            except httpx.TimeoutException:
                return
            assert reply.status_code == 200, reply.text  # served before the client gave up: allowed

    await asyncio.gather(*(one() for _ in range(REQUESTS)))


async def _abandon_grpc(address: str, key: str) -> None:
    """The same over the tenant gRPC API: each call's deadline passes long before it could finish."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.CompleteRequest(model=SERVED_MODEL, prompt="tell me a long story",
                                                params=worker_pb2.SamplingParams(max_tokens=MAX_TOKENS))

        async def one() -> None:
            try:
                async for _ in stub.Complete(request, metadata=[("authorization", f"Bearer {key}")], timeout=0.3):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc

        await asyncio.gather(*(one() for _ in range(REQUESTS)))


async def _idle(address: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(600):  # generous: the machine may be slow; the assertion is not about time
            stats = (await stub.Stats(worker_pb2.StatsRequest(), timeout=5)).values
            if stats.get("num_running", 0) == 0 and stats.get("num_waiting", 0) == 0:
                return dict(stats)
            await asyncio.sleep(0.1)
    raise AssertionError(f"the worker never became idle: {dict(stats)}")


@pytest.mark.parametrize("api", ["rest", "grpc"])
def test_abandoned_requests_are_cancelled(tmp_path_factory: pytest.TempPathFactory, api: str) -> None:
    metrics_port = free_port()
    with single_worker_gateway(tmp_path_factory, max_num_seqs=1,
                               worker_extra=("--metrics-port", str(metrics_port))) as running:
        gateway = running.gateway
        if api == "rest":
            asyncio.run(_abandon(gateway.base_url, gateway.key))
        else:
            asyncio.run(_abandon_grpc(f"127.0.0.1:{gateway.grpc_port}", gateway.key))
        stats = asyncio.run(_idle(running.worker_address))
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    aborted = _metric(metrics, "abort")
    completed = _metric(metrics, "length")
    # Queued behind one running sequence, at least three had not finished when their clients left.
    assert aborted >= REQUESTS - 1, metrics
    assert aborted + completed == REQUESTS, metrics
    assert stats["generation_tokens_total"] < REQUESTS * MAX_TOKENS
