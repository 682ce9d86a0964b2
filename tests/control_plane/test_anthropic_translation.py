"""Issue 59: the Messages API's translation to and from chat completions, piece by piece (the whole
path through the `anthropic` client is tests/e2e/test_anthropic_messages.py)."""

from __future__ import annotations

import json

import pytest

from inferplane.control_plane.gateway import anthropic_messages as am
from tests.control_plane.chat_stream_chunks import sse, text_then_tool_call


def request(**body) -> am.MessagesRequest:
    return am.parse_request(json.dumps({"model": "m", "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "Hi"}], **body}).encode())


def test_a_conversation_with_tools_becomes_the_chat_request_that_means_it() -> None:
    chat = am.to_chat(request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        stop_sequences=["END"], top_k=5,
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Call f."},
                  {"role": "assistant", "content": [{"type": "text", "text": "Calling."},
                                                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": [{"type": "text", "text": "42"}]}]}]))
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "Call f."), ("assistant", "Calling."), ("tool", "42")]
    assert chat.messages[2].tool_calls == [{"id": "t1", "type": "function",
                                            "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert chat.messages[3].tool_call_id == "t1"
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.tool_choice == "required"
    assert chat.tools[0].function.name == "f"
    named = am.to_chat(request(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                               tool_choice={"type": "tool", "name": "f"}))
    assert named.tool_choice.function.name == "f"
    streamed = am.to_chat(request(stream=True))
    assert streamed.stream and streamed.include_usage


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.type"),
    ({"container": "c-1"}, "container"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
])
def test_bad_input_names_the_field(body: dict, param: str) -> None:
    with pytest.raises(am.InvalidMessages) as caught:
        am.to_chat(request(**body))
    assert str(caught.value).startswith(param), str(caught.value)


def test_not_json_and_not_an_object() -> None:
    for raw in (b"{", b"[1]"):
        with pytest.raises(am.InvalidMessages) as caught:
            am.parse_request(raw)
        assert caught.value.param == "body"


def test_an_answer_with_a_tool_call() -> None:
    answer = am.from_completion({"choices": [{"finish_reason": "tool_calls", "message": {
        "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 2}'}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3}}, "m")
    assert answer["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 2}}]
    assert answer["stop_reason"] == "tool_use" and answer["usage"] == {"input_tokens": 7, "output_tokens": 3}


async def events(*chunks: str) -> list[dict]:
    async def source():
        for chunk in chunks:
            yield chunk

    out = []
    async for event in am.stream_events(source(), "m"):
        kind, data = event.strip().split("\n")
        assert kind == f"event: {json.loads(data[6:])['type']}"
        out.append(json.loads(data[6:]))
    return out


async def test_a_stream_of_text_then_a_tool_call() -> None:
    got = await events(*text_then_tool_call())
    kinds = [e["type"] for e in got]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in got if e.get("delta", {}).get("type") == "text_delta") == "Hello"
    assert got[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert got[6]["index"] == 1
    assert "".join(e["delta"]["partial_json"] for e in got
                   if e.get("delta", {}).get("type") == "input_json_delta") == '{"x": 1}'
    assert got[-2]["delta"]["stop_reason"] == "tool_use" and got[-2]["usage"] == {"input_tokens": 5, "output_tokens": 4}


async def test_a_broken_stream_ends_with_an_error_event() -> None:
    got = await events(sse({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}),
                       sse({"error": {"message": "the replica failed", "type": "server_error",
                                      "code": "upstream_error"}}))
    assert got[-1] == {"type": "error", "error": {"type": "api_error", "message": "the replica failed"}}
