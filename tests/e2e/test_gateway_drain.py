"""SIGTERM drains the gateway (issue 13, item 4): every stream in flight ends with its [DONE].

Fifty streams through one gateway to a worker that runs two sequences at a time, so most of them
are still queued or generating when the gateway gets SIGTERM. Before, the HTTP server gave them
five seconds and then cancelled the rest (HTTP 500s, and streams cut without an error event).
"""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from inferplane.bench.gateway_harness import SERVED_MODEL
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow

STREAMS = 50
MAX_TOKENS = 200


async def _stream(client: httpx.AsyncClient, key: str, index: int, results: dict[int, dict]) -> None:
    body = {"model": SERVED_MODEL, "prompt": f"stream {index}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = results[index] = {"status": None, "done": False, "error": None, "tokens": None}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as response:
        result["status"] = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    result["error"] = event
                elif event.get("usage"):
                    result["tokens"] = event["usage"]["completion_tokens"]


async def _scenario(gateway) -> dict[int, dict]:
    results: dict[int, dict] = {}
    limits = httpx.Limits(max_connections=STREAMS + 4, max_keepalive_connections=STREAMS + 4)
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300), limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, gateway.key, i, results)) for i in range(STREAMS)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        # Once one response has begun, give the other connections a moment to reach the gateway.
        while not any(r["status"] for r in results.values()):
            assert loop.time() < deadline, "no stream started"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        assert sum(1 for t in tasks if t.done()) < STREAMS // 2, "most streams had finished before SIGTERM"
        gateway.proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=280)
    return results


def test_sigterm_lets_every_stream_in_flight_finish(tmp_path_factory: pytest.TempPathFactory) -> None:
    with single_worker_gateway(tmp_path_factory, max_num_seqs=2,
                               gateway_extra=("--drain-grace-seconds", "240")) as running:
        gateway = running.gateway
        results = asyncio.run(_scenario(gateway))
        assert gateway.proc.wait(timeout=60) == 0  # it exits by itself once drained
        # Drained means closed: a new request now finds nobody listening.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{gateway.base_url}/healthz", timeout=5)
    assert len(results) == STREAMS
    unfinished = {i: r for i, r in results.items()
                  if not (r["status"] == 200 and r["done"] and r["error"] is None and r["tokens"] == MAX_TOKENS)}
    assert unfinished == {}, unfinished
