"""Prefill/decode disaggregation (issue 56, part 2) on real worker processes behind a gateway
process: a prefill worker computes the prompt and the first token, keeping the prompt's KV in its
tier; the decode worker pulls the blocks (FetchKV) and continues. The client's answer equals a
single worker's, token for token (greedy, and seeded sampling with n = 2), usage counts each token
once, and the decode worker computed only the prompt's last partial block."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from inferplane.bench.gateway_harness import SERVED_MODEL, free_port, start_gateway, start_worker, wait_serving
from inferplane.bench.tiny_model import make_tiny_model
from inferplane.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
BLOCK = 16
WORKER_FLAGS = ("--runtime", "radix", "--max-model-len", "512", "--block-size", str(BLOCK),
                "--kv-offload-memory", "64MiB")


@contextlib.contextmanager
def disaggregated(folder: Path, gateway_flags: tuple[str, ...] = ()) -> Iterator[tuple]:
    """Three workers: a prefill one and a decode one behind a gateway, and a reference worker on its
    own: (gateway, {role: address}, {role: process})."""
    model = make_tiny_model(folder / "tiny-model")
    roles = ("prefill", "decode", "reference")
    addresses = {role: f"127.0.0.1:{free_port()}" for role in roles}
    workers = {role: start_worker(model, int(addresses[role].rsplit(":", 1)[1]), *WORKER_FLAGS,
                                  log_path=str(folder / f"{role}.log")) for role in roles}
    gateway = None
    try:
        for role in roles:
            wait_serving(addresses[role], workers[role])
        gateway = start_gateway([addresses["decode"]], log_path=str(folder / "gateway.log"),
                                extra=("--prefill-worker", addresses["prefill"], "--min-prefill-tokens", "0",
                                       "--health-poll-interval", "0.5", *gateway_flags))
        yield gateway, addresses, workers
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        for worker in workers.values():
            worker.kill()
            worker.wait()


async def stats(address: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
    return dict(reply.values)


async def reference_texts(address: str, prompt: list[int], params: worker_pb2.SamplingParams) -> dict[int, str]:
    """The answer of one worker alone (no gateway, no disaggregation), per choice."""
    texts: dict[int, str] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        request = worker_pb2.GenerateRequest(request_id="reference", token_ids=worker_pb2.TokenIds(ids=prompt),
                                             params=params)
        async for message in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=300):
            texts[message.index] = texts.get(message.index, "") + message.text
    return texts


def prompt_ids(seed: int, length: int = 7 * BLOCK + 5) -> list[int]:
    """A prompt of token ids (the tiny model's tokenizer is byte-level): 7 full blocks and a part."""
    return [(seed * 31 + i * 7) % 200 + 20 for i in range(length)]


@pytest.mark.parametrize("body", [
    {"temperature": 0, "n": 1},
    {"temperature": 0.9, "seed": 5, "n": 2},
], ids=["greedy", "seeded-n2"])
def test_a_disaggregated_answer_equals_a_single_workers(tmp_path, body) -> None:
    with disaggregated(tmp_path) as (gateway, addresses, _):
        prompt = prompt_ids(1 if body["temperature"] == 0 else 2)
        request = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **body}
        params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=body["temperature"],
                                           ignore_eos=True, n=body["n"], **({"seed": body["seed"]} if "seed" in body
                                                                            else {}))

        async def scenario():
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
                reply = await client.post("/v1/completions", json=request,
                                          headers={"Authorization": f"Bearer {gateway.key}"})
                streamed: dict[int, str] = {}
                async with client.stream("POST", "/v1/completions", json={**request, "stream": True},
                                         headers={"Authorization": f"Bearer {gateway.key}"}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            for choice in json.loads(line[6:])["choices"]:
                                streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
            reference = await reference_texts(addresses["reference"], prompt, params)
            return reply, streamed, reference, await stats(addresses["prefill"]), await stats(addresses["decode"])

        reply, streamed, reference, prefill, decode = asyncio.run(scenario())
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    texts = {c["index"]: c["text"] for c in answer["choices"]}
    assert texts == reference and streamed == reference
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == body["n"] * MAX_TOKENS  # each token once
    full_blocks = len(prompt) // BLOCK
    # The prompt's full blocks moved once (the second request found them on the decode worker), and
    # the decode worker's prefix match used them instead of computing the prompt.
    assert prefill["kv_transfer_blocks_total:served"] == full_blocks
    assert decode["kv_transfer_blocks_total:pulled"] == full_blocks
    assert decode["prefix_hit_tokens"] >= full_blocks * BLOCK
    assert decode["kv_transfer_failures_total"] == 0


def test_with_its_prefill_worker_gone_the_decode_worker_computes_the_prompt(tmp_path) -> None:
    with disaggregated(tmp_path) as (gateway, addresses, workers):
        workers["prefill"].kill()
        workers["prefill"].wait()
        prompt = prompt_ids(3)
        request = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                   "temperature": 0}

        async def scenario():
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
                reply = await client.post("/v1/completions", json=request,
                                          headers={"Authorization": f"Bearer {gateway.key}"})
            params = worker_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            reference = await reference_texts(addresses["reference"], prompt, params)
            return reply, reference, await stats(addresses["decode"])

        reply, reference, decode = asyncio.run(scenario())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == reference[0]
    assert decode["kv_transfer_blocks_total:pulled"] == 0


def test_a_batched_prompt_list_through_the_prefill_pool_continues_only_its_unfinished_choices(tmp_path) -> None:
    """/v1/completions with two prompts: each prompt's choices are renumbered into the request's, and
    a choice that finished on the prefill replica (max_tokens 1) is not continued on the decode one."""
    with disaggregated(tmp_path) as (gateway, addresses, _):
        prompts = [prompt_ids(4), prompt_ids(5)]

        async def scenario(max_tokens: int):
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=httpx.Timeout(300)) as client:
                reply = await client.post("/v1/completions", headers={"Authorization": f"Bearer {gateway.key}"},
                                          json={"model": SERVED_MODEL, "prompt": prompts, "max_tokens": max_tokens,
                                                "ignore_eos": True, "temperature": 0})
            params = worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            return reply, [(await reference_texts(addresses["reference"], p, params))[0] for p in prompts]

        for max_tokens in (1, 12):
            reply, reference = asyncio.run(scenario(max_tokens))
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])] == reference
            assert body["usage"]["completion_tokens"] == 2 * max_tokens
