"""tool_choice auto: a template's tool-call format found, calls parsed back out of an answer; a forced
call answered whole or cut off (never as content), its arguments closed to the declared keys."""

from __future__ import annotations

import json

import pytest

from inferplane.control_plane.gateway.openai_types import ChatMessage
from inferplane.control_plane.gateway.structured_outputs import Tool, call_schema, closed
from inferplane.control_plane.gateway.tool_formats import (
    HERMES,
    held_answer,
    parse_calls,
    template_messages,
    tool_format,
)

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


# --- a forced call (tool_choice required or named): answered whole or cut off, never as content -----------

FULL_ARGUMENTS = '{"city":"Oslo","unit":"celsius"}'
FULL_CALL = '{"name":"get_weather","arguments":' + FULL_ARGUMENTS + "}"


def test_a_whole_forced_call_is_a_tool_call_even_at_max_tokens() -> None:
    for reason in ("stop", "length"):
        content, calls, finish = held_answer(FULL_CALL, reason, forced=True, fmt=None, names={"get_weather"})
        assert content is None and finish == "tool_calls"
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == json.loads(FULL_ARGUMENTS)


@pytest.mark.parametrize("names", [{"get_weather"}, {"get_weather", "get_time"}, {"get_weather", "launch"}])
def test_a_forced_call_cut_off_anywhere_is_never_content(names) -> None:
    """Every prefix of the call's JSON, as max_tokens would cut it: content is None, the reason is
    "length", and a call, when one can be told, names the right function with arguments that are a
    prefix of the whole arguments (OpenAI's answer for a cut-off call)."""
    told = 0
    for cut in range(len(FULL_CALL)):
        text = FULL_CALL[:cut]
        content, calls, finish = held_answer(text, "length", forced=True, fmt=None, names=names)
        assert content is None and finish == "length", (text, content)
        assert len(calls) <= 1
        if calls:
            told += 1
            function = calls[0]["function"]
            assert function["name"] == "get_weather" and FULL_ARGUMENTS.startswith(function["arguments"]), text
            assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
        elif cut > len('{"name":"get_weather"'):
            raise AssertionError(f"{text!r}: the name was written, but no call came back")
    # One function: even `{` tells it; with "get_time" beside it, from `{"name":"get_w` on.
    expected = len(FULL_CALL) - (0 if len(names) == 1 else len('{"name":"get_w') if "get_time" in names
                                 else len('{"name":"g'))
    assert told == expected


def test_a_cut_off_call_keeps_whitespace_and_escapes_as_written() -> None:
    text = '{ "name" : "get_weather" , "arguments" : {"city": "Os\\"lo'
    _, calls, finish = held_answer(text, "length", forced=True, fmt=None, names={"get_weather"})
    assert finish == "length" and calls[0]["function"]["arguments"] == '{"city": "Os\\"lo'


def test_a_forced_call_that_ends_otherwise_has_no_call_and_no_content() -> None:
    for reason in ("error", "stop", "abort"):  # a grammar failure; a stop string cut it
        content, calls, finish = held_answer(FULL_CALL[:30], reason, forced=True, fmt=None, names={"get_weather"})
        assert (content, calls, finish) == (None, [], reason)
    # text that is not the envelope at all (cannot come from the grammar) tells no call either
    assert held_answer("hello", "length", forced=True, fmt=None, names={"get_weather"}) == (None, [], "length")


# --- a forced call's arguments: only the keys the function declares ---------------------------------------


def test_parameters_without_additional_properties_are_closed_where_they_declare_properties() -> None:
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},  # nested: closed
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "either": {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]},
            "free": {"type": "object"},  # no properties declared: any key (json_guard keeps them distinct)
            "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},  # said: kept
            "typed": {"type": "object", "properties": {"x": {}}, "additionalProperties": {"type": "object",
                                                                                         "properties": {"y": {}}}},
            "pattern": {"type": "object", "properties": {"x": {}}, "patternProperties": {"^y": {}}},
            "properties": {"type": "object", "properties": {"not": {}}},  # a property named like a keyword
        },
        "$defs": {"P": {"type": "object", "properties": {"q": {}}}},
    }
    before = json.dumps(parameters)
    out = closed(parameters)
    assert json.dumps(parameters) == before, "the tool's own schema was changed"
    p = out["properties"]
    assert out["additionalProperties"] is False
    assert p["where"]["additionalProperties"] is False
    assert p["tags"]["items"]["additionalProperties"] is False
    assert p["either"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in p["either"][
        "anyOf"][1]
    assert "additionalProperties" not in p["free"]
    assert p["open"]["additionalProperties"] is True
    assert p["typed"]["additionalProperties"] == {"type": "object", "properties": {"y": {}},
                                                  "additionalProperties": False}
    assert "additionalProperties" not in p["pattern"]
    assert p["properties"]["additionalProperties"] is False and p["properties"]["properties"] == {"not": {}}
    assert out["$defs"]["P"]["additionalProperties"] is False


def test_composed_schemas_are_left_open() -> None:
    """allOf adds its members' properties up: closing one member would refuse the others' keys."""
    parameters = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"$ref": "#/$defs/B"}],
                  "$defs": {"B": {"type": "object", "properties": {"b": {}}}}}
    assert closed(parameters) == parameters
    negated = {"type": "object", "properties": {"a": {}}, "not": {"type": "object", "properties": {"b": {}}}}
    assert "additionalProperties" not in closed(negated)["not"]


def test_objects_whose_keys_other_subschemas_declare_are_left_open() -> None:
    """A tagged union (properties beside oneOf members that declare more of the same object's keys),
    if/then/else and dependentSchemas, and a `required` key the object's own properties do not
    declare: closing would refuse what the schema admits (the review of issue 53's fix)."""
    import jsonschema
    import llguidance

    tagged = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
              "oneOf": [{"properties": {"kind": {"const": "a"}, "a": {"type": "integer"}}, "required": ["a"]},
                        {"properties": {"kind": {"const": "b"}, "b": {"type": "string"}}, "required": ["b"]}]}
    conditional = {"type": "object", "properties": {"kind": {"type": "string"}},
                   "if": {"properties": {"kind": {"const": "a"}}}, "then": {"properties": {"a": {}}}}
    dependent = {"type": "object", "properties": {"x": {}}, "dependentSchemas": {"x": {"properties": {"y": {}}}}}
    undeclared_required = {"type": "object", "properties": {"x": {}}, "required": ["x", "y"]}
    for schema, instance in ((tagged, {"kind": "a", "a": 1}), (tagged, {"kind": "b", "b": "s"}),
                             (conditional, {"kind": "a", "a": 1}), (dependent, {"x": 1, "y": 2}),
                             (undeclared_required, {"x": 1, "y": 2})):
        out = closed(schema)
        jsonschema.validate(instance, out)  # what the schema admits is still admitted
        # the grammar engine finds no more fault in it than in the schema as the tool wrote it (it
        # does not implement if/then at all; closing the tagged union made it unsatisfiable)
        verdicts = [llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(s))
                    for s in (schema, out)]
        assert verdicts[1] == verdicts[0], (schema, out, verdicts)
    # a union of whole objects (no object keys beside it) is still closed member by member
    union = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert [m["additionalProperties"] for m in closed(union)["anyOf"]] == [False, False]


def test_the_call_schema_closes_every_tools_parameters() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}) for name in ("one", "two")]
    schema = call_schema(tools)
    assert [v["properties"]["arguments"]["additionalProperties"] for v in schema["anyOf"]] == [False, False]
    assert call_schema(tools[:1])["properties"]["arguments"]["additionalProperties"] is False
    bare = Tool.model_validate({"type": "function", "function": {"name": "bare"}})
    assert call_schema([bare])["properties"]["arguments"] == {"type": "object"}
