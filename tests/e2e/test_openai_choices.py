"""Issue 17: `n` choices and several prompts per request, through the whole path (official `openai`
client -> gateway -> worker), on the tiny model. The worker computes each prompt once and forks its
KV blocks to the other choices; its stats show it."""

from __future__ import annotations

import grpc
import pytest
from openai import AsyncOpenAI

from inferplane.v1 import worker_pb2, worker_pb2_grpc
from inferplane.worker.engine.kv.manager import fork_layout
from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the sea and the sky"}]


@pytest.fixture
def client(in_process_gateway) -> AsyncOpenAI:
    return openai_client(in_process_gateway, "choices")


async def worker_stats(address: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10)
    return dict(reply.values)


async def test_n_choices_fork_the_prompt_once_and_each_is_reproducible(client, tiny_worker) -> None:
    _, address = tiny_worker
    before = await worker_stats(address)
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=2.0,
                                                  seed=7, n=3)
    after = await worker_stats(address)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    # Choice i samples with seed 7 + i (vLLM's rule): each equals a one-choice request with that seed.
    # (Whether the texts differ is up to the model: the tiny one puts 99.5% on one token here.)
    for i in (1, 2):
        one = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=2.0,
                                                   seed=7 + i)
        assert one.choices[0].message.content == texts[i]
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)

    # One prompt: two forks sharing its whole blocks; the prompt counted once in the usage.
    prompt_tokens = answer.usage.prompt_tokens
    shared, _ = fork_layout(prompt_tokens, int(after["block_size"]))
    assert after["forked_sequences"] - before["forked_sequences"] == 2
    assert after["forked_shared_blocks"] - before["forked_shared_blocks"] == 2 * shared
    alone = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=2.0, seed=7)
    assert alone.usage.prompt_tokens == prompt_tokens
    assert alone.choices[0].message.content == texts[0]
    assert answer.usage.completion_tokens > alone.usage.completion_tokens

    # Streamed: every choice's deltas under its index, one finish each, the same texts.
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=2.0,
                                                  seed=7, n=3, stream=True, stream_options={"include_usage": True})
    streamed, finishes, usage = {0: "", 1: "", 2: ""}, [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.index)
    assert sorted(finishes) == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == texts
    assert usage.completion_tokens == answer.usage.completion_tokens


async def test_several_prompts_with_n_choices_each_in_openais_order(client) -> None:
    prompts = ["The cat", "A long way from home", "Numbers: 1 2 3"]
    answer = await client.completions.create(model="m", prompt=prompts, n=2, max_tokens=6, temperature=0,
                                             echo=True)
    assert [c.index for c in answer.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = await client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
        for j in range(2):  # greedy: both choices of a prompt are its lone answer, after the echo
            assert answer.choices[i * 2 + j].text == prompt + alone.choices[0].text
    lone_usage = [(await client.completions.create(model="m", prompt=p, max_tokens=1)).usage.prompt_tokens
                  for p in prompts]
    assert answer.usage.prompt_tokens == sum(lone_usage)

    stream = await client.completions.create(model="m", prompt=[[9, 10, 11], [5, 6, 7, 8]], max_tokens=5,
                                             temperature=0, stream=True)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1]
    by_ids = await client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=5, temperature=0)
    assert texts[1] == by_ids.choices[0].text


async def test_forced_tool_calls_with_n_choices(client) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, tools=tools, tool_choice="required",
                                                  n=2, max_tokens=60, temperature=0.7, seed=3)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls[0].function.name == "weather"
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, tools=tools, tool_choice="required",
                                                  n=2, max_tokens=60, temperature=0.7, seed=3, stream=True)
    calls = {}
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.tool_calls:
                calls[choice.index] = choice.delta.tool_calls[0].function.arguments
    assert calls == {c.index: c.message.tool_calls[0].function.arguments for c in answer.choices}


async def _collect(call) -> tuple[dict[int, str], dict[int, object]]:
    texts: dict[int, str] = {}
    finals: dict[int, object] = {}
    async for out in call:
        texts[out.index] = texts.get(out.index, "") + out.text
        if out.finished:
            finals[out.index] = out
    return texts, finals


async def test_the_grpc_api_serves_choices_constraints_and_forced_calls(grpc_stub) -> None:
    import json

    import jsonschema

    from inferplane.v1 import inference_pb2

    stub, key = grpc_stub
    params = worker_pb2.SamplingParams(max_tokens=8, temperature=2.0, seed=5, n=3)
    request = inference_pb2.CompleteRequest(model="m", prompt="hello", params=params)
    texts, finals = await _collect(stub.Complete(request, metadata=key, timeout=120))
    assert sorted(texts) == sorted(finals) == [0, 1, 2]

    # A choice constraint (vLLM's structured_outputs on REST) holds on every choice.
    choice = worker_pb2.SamplingParams(max_tokens=10, temperature=1.0, n=2, constraint_kind="choice",
                                       constraint_spec=json.dumps(["yes", "no"]))
    texts, _ = await _collect(stub.Complete(inference_pb2.CompleteRequest(model="m", prompt="ok?", params=choice),
                                            metadata=key, timeout=120))
    assert set(texts.values()) <= {"yes", "no"} and len(texts) == 2
    regex = worker_pb2.SamplingParams(max_tokens=12, temperature=1.0, constraint_kind="regex",
                                      constraint_spec="[0-9]{3}")
    texts, _ = await _collect(stub.Chat(inference_pb2.ChatRequest(
        model="m", messages=[worker_pb2.ChatMessage(role="user", content="a number")], params=regex),
        metadata=key, timeout=120))
    assert texts[0].isdigit() and len(texts[0]) == 3

    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
              "additionalProperties": False}
    call = stub.Chat(inference_pb2.ChatRequest(
        model="m", messages=[worker_pb2.ChatMessage(role="user", content="weather?")],
        params=worker_pb2.SamplingParams(max_tokens=60, temperature=0.7, seed=3),
        tools=[inference_pb2.Tool(name="weather", parameters_json=json.dumps(schema))], tool_choice="weather"),
        metadata=key, timeout=120)
    texts, finals = await _collect(call)
    final = finals[0]
    assert final.finish_reason == "tool_calls" and texts[0] == ""
    assert final.tool_calls[0].name == "weather" and final.tool_calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(final.tool_calls[0].arguments_json), schema)

    bad = worker_pb2.SamplingParams(max_tokens=4, constraint_kind="xml")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _collect(stub.Complete(inference_pb2.CompleteRequest(model="m", prompt="x", params=bad),
                                     metadata=key, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.constraint_kind" in refused.value.details()
