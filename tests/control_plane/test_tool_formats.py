"""tool_choice auto: a template's tool-call format found, calls parsed back out of an answer."""

from __future__ import annotations

import json

from inferplane.control_plane.gateway.openai_types import ChatMessage
from inferplane.control_plane.gateway.tool_formats import HERMES, parse_calls, template_messages, tool_format

NAMES = {"weather", "time"}


def test_the_format_is_read_from_the_template() -> None:
    assert tool_format("{% if tools %}... <tool_call>{...}</tool_call>{% endif %}") == HERMES
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


def test_hermes_calls_are_parsed_and_the_rest_stays_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    content, calls = parse_calls(text, HERMES, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_what_is_not_a_whole_call_to_a_declared_tool_stays_text() -> None:
    for text in ('<tool_call>{"name": "weather", "arguments": {"city": "Os',  # cut off by max_tokens
                 '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not declared
                 '<tool_call>not json</tool_call>', "plain answer"):
        assert parse_calls(text, HERMES, NAMES) == (text, [])
    assert parse_calls('<tool_call>{"name": "time", "arguments": {}}</tool_call>', None, NAMES)[1] == []


def test_messages_carry_calls_and_results_as_fields_for_the_template() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[call]),
                ChatMessage(role="tool", content="-3", tool_call_id="call_1")]
    rendered = template_messages(messages)
    assert rendered[1]["content"] == "" and rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert rendered[2] == {"role": "tool", "content": "-3", "tool_call_id": "call_1"}
