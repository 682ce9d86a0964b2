"""Issue 53: a forced tool call cut off by max_tokens is answered as OpenAI answers one: finish_reason
"length", no content, the call with the arguments written so far, never the grammar's envelope
(`{"name": ..., "arguments": ...`) as content; through REST (whole and streamed) and gRPC, on the
tiny model's worker and gateway."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "weather?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "minLength": 20}, "note": {"type": "string"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HEAD = '{"name":"get_weather","arguments":'


def check_cut_call(calls, text: str) -> None:
    """One call to get_weather whose arguments are what the model wrote after the envelope's head."""
    (call,) = calls
    name, arguments = (call.function.name, call.function.arguments) if hasattr(call, "function") else (
        call.name, call.arguments_json)
    assert name == "get_weather"
    assert arguments.startswith("{") and text == "", (arguments, text)
    with pytest.raises(ValueError):
        json.loads(arguments)  # cut off: not whole


@pytest.mark.parametrize("choice", ["required", NAMED])
async def test_a_cut_off_forced_call_is_a_length_answer_with_partial_arguments(in_process_gateway, choice) -> None:
    client = openai_client(in_process_gateway, "cut")
    max_tokens = len(HEAD) + 6  # the tiny model's tokens are bytes: cut inside the arguments
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens,
                                                  temperature=1.0, seed=5, n=3, tools=[WEATHER],
                                                  tool_choice=choice)
    for out in answer.choices:
        assert out.finish_reason == "length" and out.message.content is None, out.message
        check_cut_call(out.message.tool_calls, "")

    stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=max_tokens,
                                                  temperature=1.0, seed=5, tools=[WEATHER], tool_choice=choice,
                                                  stream=True)
    deltas = [c.choices[0] async for c in stream if c.choices]
    assert not any(d.delta.content for d in deltas)
    check_cut_call([c for d in deltas for c in d.delta.tool_calls or []], "")
    assert deltas[-1].finish_reason == "length"


async def test_a_call_cut_before_its_function_is_known_has_no_call_and_no_content(in_process_gateway) -> None:
    client = openai_client(in_process_gateway, "cut")
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=len('{"name":"get_'),
                                                  temperature=0, tools=[WEATHER, TIME], tool_choice="required")
    out = answer.choices[0]
    assert out.finish_reason == "length" and out.message.content is None and not out.message.tool_calls


async def test_grpc_answers_a_cut_off_call_the_same_way(in_process_gateway, grpc_stub) -> None:
    from inferplane.v1 import inference_pb2, worker_pb2

    stub, key = grpc_stub
    request = inference_pb2.ChatRequest(
        model="m", messages=[worker_pb2.ChatMessage(role="user", content="weather?")],
        params=worker_pb2.SamplingParams(max_tokens=len(HEAD) + 6, temperature=1.0, seed=5),
        tools=[inference_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER["function"]["parameters"]))],
        tool_choice="required")
    finals = [out async for out in stub.Chat(request, metadata=key, timeout=120) if out.finished]
    assert finals[0].finish_reason == "length"
    check_cut_call(finals[0].tool_calls, finals[0].text)
