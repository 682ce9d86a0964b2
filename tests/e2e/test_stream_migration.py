"""Streams that survive a dying worker (issue 56): a worker is SIGKILLed while it streams an answer;
the gateway moves the request to the other replica with the tokens delivered so far, and the client
reads one whole answer equal to an uninterrupted run's, with no error event, each token once, and
usage counting each token once. Greedy and seeded sampling, one choice and n = 2, streamed and not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from inferplane.bench.gateway_harness import (
    SERVED_MODEL,
    GatewayProcess,
    free_port,
    start_gateway,
    start_worker,
    wait_serving,
)
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow
MAX_TOKENS = 200
ROUNDS = 5  # the answer may finish before the freeze lands: a race in the set-up, run again
BODY = {"prompt": "tell me a long story about the sea", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


@contextlib.contextmanager
def stack(folder: Path, count: int, worker_flags: tuple[str, ...] = (), gateway_flags: tuple[str, ...] = (),
          model: str | None = None) -> Iterator[tuple[GatewayProcess, dict, str]]:
    """`count` tiny-model workers behind a gateway process: (gateway, {address: process}, model)."""
    model = model or make_tiny_model(folder / "tiny-model")
    ports = [free_port() for _ in range(count)]
    workers = {f"127.0.0.1:{p}": start_worker(model, p, "--max-model-len", "256", *worker_flags,
                                              log_path=str(folder / f"worker-{i}.log"))
               for i, p in enumerate(ports)}
    gateway = None
    try:
        for address, worker in workers.items():
            wait_serving(address, worker)
        gateway = start_gateway(list(workers), log_path=str(folder / "gateway.log"),
                                extra=("--health-poll-interval", "0.5", *gateway_flags))
        yield gateway, workers, model
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        for worker in workers.values():
            worker.kill()
            worker.wait()


@pytest.fixture
def two_replicas(tmp_path, request):
    """Two workers behind a gateway (started with `request.param`'s flags, if any)."""
    with stack(tmp_path, 2, gateway_flags=getattr(request, "param", ())) as running:
        yield running


async def running_on(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
    return stats.values.get("num_running", 0) >= 1


async def read_stream(client: httpx.AsyncClient, key: str, body: dict, on_first=None) -> tuple[dict, dict, list]:
    """(text per choice, finish reason per choice, usage, error events) of one streamed completion."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage, errors = {}, []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}},
                             headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event)
                continue
            for choice in event["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
            if event.get("usage"):
                usage = event["usage"]
            if on_first is not None and texts:
                await on_first()
                on_first = None
    return {"texts": texts, "reasons": reasons}, usage, errors


async def killed_mid_stream(client: httpx.AsyncClient, key: str, workers: dict, body: dict):
    """A streamed request whose worker is SIGKILLed once the first text arrived (run again where the
    answer finished first: a race in the set-up, not a result)."""
    killed: list[str] = []

    async def kill_the_streaming_worker() -> None:
        for address, worker in workers.items():
            if worker.poll() is None and await running_on(address):
                worker.send_signal(signal.SIGKILL)
                killed.append(address)
                return

    for _ in range(ROUNDS):
        got = await read_stream(client, key, body, kill_the_streaming_worker)
        if killed:
            return got
    raise AssertionError(f"in {ROUNDS} rounds the answer always finished before its worker could be killed")


@pytest.mark.parametrize("body", [
    {"temperature": 0, "n": 1},
    {"temperature": 0.9, "seed": 11, "n": 2},
], ids=["greedy", "seeded-n2"])
def test_a_stream_goes_on_elsewhere_when_its_worker_dies(two_replicas, body) -> None:
    gateway, workers, _ = two_replicas
    body = {"model": SERVED_MODEL, **BODY, **body}

    async def scenario():
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
            answer, usage, errors = await killed_mid_stream(client, gateway.key, workers, body)
            # The same request answered by the survivor alone, uninterrupted.
            reference, _, _ = await read_stream(client, gateway.key, body)
            plain = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {gateway.key}"})
            return answer, usage, errors, reference, plain.json()

    answer, usage, errors, reference, plain = asyncio.run(scenario())
    n = body["n"]
    assert errors == []
    assert answer["texts"] == reference["texts"] and len(answer["texts"]) == n
    assert all(reason == "length" for reason in answer["reasons"].values())
    assert usage["completion_tokens"] == n * MAX_TOKENS  # each token once
    assert [c["text"] for c in sorted(plain["choices"], key=lambda c: c["index"])] == \
        [reference["texts"][i] for i in range(n)]


@pytest.mark.parametrize("two_replicas", [("--max-migrations", "0")], indirect=True)
def test_with_migrations_off_a_broken_stream_ends_with_an_error_event(two_replicas) -> None:
    gateway, workers, _ = two_replicas
    body = {"model": SERVED_MODEL, **BODY}

    async def scenario():
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
            return await killed_mid_stream(client, gateway.key, workers, body)

    answer, _, errors = asyncio.run(scenario())
    assert [e["error"]["code"] for e in errors] == ["upstream_error"]
    assert 0 < len(answer["texts"][0]) < MAX_TOKENS


async def kill_once_running(workers: dict, killed: list[str]) -> None:
    """SIGKILLs the worker running a request as soon as one is (a request not streamed to the client
    has no first chunk to wait for)."""
    while not killed:
        for address, worker in workers.items():
            if worker.poll() is None and await running_on(address):
                worker.send_signal(signal.SIGKILL)
                killed.append(address)
                return
        await asyncio.sleep(0.005)


def test_an_answer_not_streamed_and_one_on_the_grpc_api_survive_their_worker_too(two_replicas) -> None:
    """REST without streaming, then the gRPC tenant API, each killed while its worker answers (a new
    worker takes the first dead one's place in between)."""
    gateway, workers, model = two_replicas
    from inferplane.v1 import inference_pb2, inference_pb2_grpc

    body = {"model": SERVED_MODEL, **BODY}
    headers = {"Authorization": f"Bearer {gateway.key}"}

    async def scenario():
        killed: list[str] = []
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
            killer = asyncio.create_task(kill_once_running(workers, killed))
            reply = await client.post("/v1/completions", json=body, headers=headers)
            await killer
            reference = await client.post("/v1/completions", json=body, headers=headers)
        return killed, reply, reference

    killed, reply, reference = asyncio.run(scenario())
    assert killed and reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert reply.json()["usage"]["completion_tokens"] == MAX_TOKENS

    # The gRPC tenant API on the same gateway: a worker is started again in the dead one's place.
    dead = killed[0]
    workers[dead] = start_worker(model, int(dead.rsplit(":", 1)[1]), "--max-model-len", "256")
    wait_serving(dead, workers[dead])
    time.sleep(2)  # the gateway's health checks (every 0.5 s) take it back
    async def over_grpc():
        killed.clear()
        params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = inference_pb2.CompleteRequest(model=SERVED_MODEL, prompt=body["prompt"], params=params)
        metadata = [("authorization", f"Bearer {gateway.key}")]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            killer = asyncio.create_task(kill_once_running(workers, killed))
            text = "".join([m.text async for m in stub.Complete(request, metadata=metadata, timeout=300)])
            await killer
            again = "".join([m.text async for m in stub.Complete(request, metadata=metadata, timeout=300)])
        return text, again

    text, again = asyncio.run(over_grpc())
    assert killed and text == again == reference.json()["choices"][0]["text"]


def test_a_stream_under_a_lora_adapter_moves_with_its_adapter(tmp_path) -> None:
    """The moved request carries its adapter: the new replica loads it and continues the adapter's
    answer (which differs from the base's), equal to an uninterrupted run's."""
    from inferplane.api.model_config import read_model_config
    from inferplane.bench.fairness_adapters import RANK, write_valid_adapter
    from inferplane.bench.gateway_harness import TENANT

    model = make_tiny_model(tmp_path / "tiny")
    root = (tmp_path / "adapters").resolve()
    adapter = write_valid_adapter(root / "sea-bot", read_model_config(model), seed=1)
    gateway_flags = ("--model-root", str(root), "--register-base", model, "--adapter", f"{TENANT}=sea-bot={adapter}")
    with stack(tmp_path, 2, ("--max-loras", "2", "--max-lora-rank", str(RANK)), gateway_flags, model) as running:
        gateway, workers, _ = running
        body = {"model": "sea-bot", **BODY}

        async def scenario():
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
                answer, usage, errors = await killed_mid_stream(client, gateway.key, workers, body)
                reference, _, _ = await read_stream(client, gateway.key, body)
                base, _, _ = await read_stream(client, gateway.key, {**body, "model": SERVED_MODEL})
            return answer, usage, errors, reference, base

        answer, usage, errors, reference, base = asyncio.run(scenario())
    assert errors == [] and usage["completion_tokens"] == MAX_TOKENS
    assert answer["texts"] == reference["texts"]
    assert answer["texts"] != base["texts"]  # the adapter's answer, not the base's


def test_with_no_other_replica_a_broken_stream_ends_with_an_error_event(tmp_path) -> None:
    with stack(tmp_path, 1) as (gateway, workers, _):
        body = {"model": SERVED_MODEL, **BODY}

        async def scenario():
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
                return await killed_mid_stream(client, gateway.key, workers, body)

        answer, _, errors = asyncio.run(scenario())
    assert [e["error"]["code"] for e in errors] == ["upstream_error"]  # as before migration existed
    assert 0 < len(answer["texts"][0]) < MAX_TOKENS
