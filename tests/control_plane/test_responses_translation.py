"""OpenAI's Responses API: its translation to and from chat completions, piece by piece (the whole
path through the `openai` client is tests/e2e/test_responses_api.py; storage is
test_stored_responses.py)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from inferplane.control_plane.gateway import responses_output as ro
from inferplane.control_plane.gateway import responses_request as rq
from tests.control_plane.chat_stream_chunks import sse, text_then_tool_call


def request(**body) -> rq.ResponsesRequest:
    return rq.parse_request(json.dumps({"model": "m", "input": "Hi", **body}).encode())


def chat(**body):
    parsed = request(**body)
    return rq.to_chat(parsed, [], rq.input_items(parsed))


def test_a_conversation_with_a_tool_round_trip_becomes_the_chat_request_that_means_it() -> None:
    converted = chat(
        instructions="Be brief.", temperature=0, top_p=0.5, max_output_tokens=7, user="u-1", parallel_tool_calls=False,
        metadata={"k": "v"}, store=False,
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        tool_choice="required",
        input=[{"role": "developer", "content": "Use tools."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Call "},
                                                               {"type": "input_text", "text": "f."}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling.",
                                                                     "annotations": []}],
                "id": "msg_1", "status": "completed"},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}', "id": "fc_1"},
               {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "42"},
               {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "7"}]}])
    assert [(m.role, m.content) for m in converted.messages] == [
        ("system", "Be brief."), ("developer", "Use tools."), ("user", "Call f."), ("assistant", "Calling."),
        ("tool", "42"), ("tool", "7")]
    # both calls join the assistant's turn they follow, as chat writes text and calls in one turn
    assert converted.messages[3].tool_calls == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert [m.tool_call_id for m in converted.messages[4:]] == ["c1", "c2"]
    assert converted.temperature == 0 and converted.top_p == 0.5 and converted.asked_max_tokens() == 7
    assert converted.user == "u-1" and converted.parallel_tool_calls is False and converted.tool_choice == "required"
    assert converted.tools[0].function.name == "f" and converted.tools[0].function.description == "d"
    assert not converted.stream


def test_tool_choice_text_format_and_streaming_map_to_the_chat_fields() -> None:
    named = chat(tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "f"})
    assert named.tool_choice.function.name == "f" and named.forced_tools[0].function.name == "f"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formatted = chat(text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    assert formatted.response_format.type == "json_schema"
    assert formatted.response_format.json_schema.json_schema == schema and formatted.response_format.json_schema.strict
    assert formatted.constraint() == ("json_schema", json.dumps(schema))
    assert chat(text={"format": {"type": "json_object"}}).constraint() == ("json_object", "")
    assert chat(text={"format": {"type": "text"}}).constraint() == ("", "")
    streamed = chat(stream=True)
    assert streamed.stream and streamed.include_usage
    # a one-string input is one user message
    assert [(m.role, m.content) for m in chat().messages] == [("user", "Hi")]


def test_a_previous_conversation_comes_first_and_its_instructions_do_not() -> None:
    parsed = request(instructions="Now terse.",
                     input=[{"type": "function_call_output", "call_id": "c1", "output": "9"}])
    earlier = [{"type": "message", "role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}", "id": "fc_1",
                "status": "completed"}]
    converted = rq.to_chat(parsed, earlier, rq.input_items(parsed))
    assert [m.role for m in converted.messages] == ["system", "user", "assistant", "tool"]
    assert converted.messages[0].content == "Now terse." and converted.messages[2].tool_calls[0]["id"] == "c1"


@pytest.mark.parametrize("body, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": ["Hi"]}, "input[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]}, "tools[1].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_bad_input_names_the_field(body: dict, param: str) -> None:
    with pytest.raises(rq.InvalidRequest) as caught:
        chat(**body)
    assert caught.value.param == param, str(caught.value)
    assert str(caught.value).startswith(f"{param}: ")


def test_neutral_values_of_unserved_fields_and_unknown_fields_are_accepted() -> None:
    chat(background=False, include=[], reasoning={"effort": None}, truncation="disabled", top_logprobs=0,
         service_tier="auto", prompt_cache_key="k", safety_identifier="s", no_such_field=1)


def test_text_that_is_not_unicode_names_where_it_is() -> None:
    raw = b'{"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "\\ud800"}]}]}'
    with pytest.raises(rq.InvalidRequest) as caught:
        rq.parse_request(raw)
    assert caught.value.param == "input[0].content[0].text"


def test_not_json_and_not_an_object() -> None:
    for raw, code in ((b"{", "invalid_json"), (b"[1]", "invalid_value")):
        with pytest.raises(rq.InvalidRequest) as caught:
            rq.parse_request(raw)
        assert caught.value.param == "body" and caught.value.code == code


def test_chat_errors_are_renamed_to_the_responses_fields() -> None:
    assert rq.responses_param("max_tokens") == "max_output_tokens"
    assert rq.responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert rq.responses_param("messages") == "input" and rq.responses_param("tools.3.function.name") == "tools[3].name"
    assert rq.responses_message("the prompt has 9 tokens and max_tokens is 300.", "max_tokens") == \
        "the prompt has 9 tokens and max_output_tokens is 300."


BASE = ro.skeleton(request(tools=[{"type": "function", "name": "f"}], metadata={"k": "v"}), "resp_1", 1)


def test_a_whole_answer_with_text_and_a_tool_call_is_a_response_the_client_parses() -> None:
    completion = {"choices": [{"finish_reason": "tool_calls", "message": {
        "content": "Calling.", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 2}'}}]}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}}
    answer = Response.model_validate(ro.from_completion(completion, BASE))
    assert answer.status == "completed" and answer.output_text == "Calling." and answer.id == "resp_1"
    message, call = answer.output
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    assert call.type == "function_call" and call.call_id == "c1" and call.name == "f" and call.arguments == '{"x": 2}'
    assert answer.usage.input_tokens == 7 and answer.usage.output_tokens == 3 and answer.usage.total_tokens == 10
    assert answer.usage.input_tokens_details.cached_tokens == 4
    assert answer.usage.output_tokens_details.reasoning_tokens == 0
    assert answer.metadata == {"k": "v"} and answer.tools[0].name == "f" and answer.tool_choice == "auto"


def test_an_answer_cut_off_by_max_output_tokens_is_incomplete() -> None:
    answer = ro.from_completion({"choices": [{"finish_reason": "length", "message": {"content": "abc"}}]}, BASE)
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["status"] == "incomplete"


async def events(*chunks: str, base: dict = BASE) -> tuple[list[dict], ro.ResponseEvents]:
    async def source():
        for chunk in chunks:
            yield chunk

    stream = ro.ResponseEvents(base)
    out = []
    async for event in stream.events(source()):
        if event.startswith(":"):
            out.append({"type": "comment"})
            continue
        kind, data = event.strip().split("\n")
        payload = json.loads(data[6:])
        assert kind == f"event: {payload['type']}"
        TypeAdapter(ResponseStreamEvent).validate_python(payload)  # the client's own type for it
        out.append(payload)
    return out, stream


async def test_a_stream_of_text_then_a_tool_call_in_order_with_sequence_numbers() -> None:
    got, stream = await events(*text_then_tool_call())
    events_only = [e for e in got if e["type"] != "comment"]
    assert [e["type"] for e in events_only] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events_only] == list(range(len(events_only)))
    assert got[2] == {"type": "comment"}  # the chat stream's keep-alive, after the opening events
    text_item, call_item = events_only[8]["item"], events_only[13]["item"]
    assert events_only[6]["text"] == "Hello" and text_item["content"][0]["text"] == "Hello"
    assert {e["output_index"] for e in events_only[2:9]} == {0}
    assert {e["output_index"] for e in events_only[9:14]} == {1}
    assert events_only[9]["item"]["arguments"] == "" and events_only[12]["arguments"] == '{"x": 1}'
    assert call_item["call_id"] == "c1" and call_item["name"] == "f" and call_item["status"] == "completed"
    final = Response.model_validate(events_only[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello" and final.usage.total_tokens == 9
    assert [item.id for item in final.output] == [text_item["id"], call_item["id"]]
    assert stream.final == events_only[-1]["response"]
    assert events_only[0]["response"]["status"] == "in_progress" and events_only[0]["response"]["id"] == "resp_1"


async def test_a_stream_cut_off_by_max_output_tokens_ends_incomplete() -> None:
    got, stream = await events(
        sse({"choices": [{"index": 0, "delta": {"content": "abc"}, "finish_reason": None}]}),
        sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}))
    assert got[-1]["type"] == "response.incomplete"
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert got[-2]["item"]["status"] == "incomplete" and stream.final["status"] == "incomplete"


async def test_an_empty_answer_is_one_empty_message_as_the_whole_answer_is() -> None:
    got, _ = await events(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    whole = ro.from_completion({"choices": [{"finish_reason": "stop", "message": {"content": ""}}]}, BASE)
    assert [item["content"] for item in got[-1]["response"]["output"]] == [item["content"] for item in whole["output"]]


async def test_a_broken_stream_ends_with_an_error_event_and_response_failed() -> None:
    got, stream = await events(
        sse({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}),
        sse({"error": {"message": "the replica failed", "type": "service_unavailable", "param": None,
                       "code": "upstream_error"}}))
    assert got[-2] == {"type": "error", "code": "upstream_error", "message": "the replica failed", "param": None,
                       "sequence_number": len(got) - 2}
    assert got[-1]["type"] == "response.failed" and got[-1]["response"]["status"] == "failed"
    assert got[-1]["response"]["error"] == {"code": "server_error", "message": "the replica failed"}
    assert stream.final is None  # nothing to store
