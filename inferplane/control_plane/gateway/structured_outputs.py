"""OpenAI's `response_format`, `tools` and `tool_choice`, turned into the worker's output constraint,
and a constrained tool call turned back into `tool_calls`.

`response_format` json_object / json_schema constrain the output to JSON (matching the schema).
`tool_choice: "required"` or a named function constrains the output to a call object
`{"name": <a declared function>, "arguments": <its parameters schema, closed to the keys it
declares>}`, so even a small model returns a valid call; the gateway answers it as `tool_calls`
(cut off by max_tokens: finish_reason "length" with the arguments written so far). `tool_choice: "auto"` (the default
when tools are given) leaves the choice to the model, in its chat template's own format
(tool_formats.py); a template without one answers as `none` (README). The grammar engine (the worker's) checks
the schemas; one it cannot compile is a 400 naming `response_format`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inferplane.api.grammar_limits import MAX_CONSTRAINT_CHOICES, MAX_REGEX_CHARS

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("json_schema.schema is required with type json_schema")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of a JSON schema, a regex the whole output
    matches, or a list of strings the output is one of."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_REGEX_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CONSTRAINT_CHOICES)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex or choice")
        return self

    def constraint(self) -> tuple[str, str]:
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        schema = self.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)


def extension_constraint(structured: StructuredOutputs | None, guided_regex: str | None,
                         guided_choice: list[str] | None, guided_json: dict[str, Any] | str | None) -> tuple[str, str]:
    """(kind, spec) from vLLM's extensions: `structured_outputs`, or the older `guided_regex`,
    `guided_choice` and `guided_json`. Raises ValueError (naming the fields) if more than one is given."""
    given = {name: value for name, value in (("structured_outputs", structured), ("guided_regex", guided_regex),
                                             ("guided_choice", guided_choice), ("guided_json", guided_json))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"{next(iter(given))}: give one output constraint, got {', '.join(given)}")
    if structured is not None:
        return structured.constraint()
    if guided_regex is not None:
        return StructuredOutputs(regex=guided_regex).constraint()
    if guided_choice is not None:
        return StructuredOutputs(choice=guided_choice).constraint()
    if guided_json is not None:
        return StructuredOutputs(json=guided_json).constraint()
    return "", ""


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """The JSON a forced call is: the function's name and arguments matching its parameters, whose
    objects take only the properties they declare (`closed`)."""
    variants = [{"type": "object", "properties": {
        "name": {"const": t.function.name},
        "arguments": closed(t.function.parameters or {"type": "object"})},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


# Keywords whose values are schemas the arguments' JSON must match as written; `allOf` (its members'
# properties add up, so closing one would refuse another's), `not`, `if`/`then`/`else` and the like
# are left as they are.
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref")
# Keywords beside `properties` whose subschemas may declare more of the same object's keys (a tagged
# union: `properties: {kind}` with `oneOf: [{properties: {kind, a}}, {properties: {kind, b}}]`): such
# an object, and those members, are left open, since closing either refuses keys the other declares.
_MERGING_KEYWORDS = ("anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "dependencies")


def closed(schema: Any) -> Any:
    """A function's parameters schema with `additionalProperties: false` on every object schema that
    declares `properties` and says nothing about other keys. JSON Schema's default admits any
    undeclared key, and a small model forced into a call then writes made-up keys (issue 53: one
    key 25 times) until max_tokens; a function's declared parameters are all it takes (OpenAI's
    strict mode requires the same). An object that declares no properties stays open, and a schema
    that says additionalProperties (or patternProperties, unevaluatedProperties) keeps what it says;
    members of `allOf` and definitions it may reach are left open, since closing one member would
    refuse the properties another declares. A copy; the tool's own schema is not changed."""
    if not isinstance(schema, dict):
        return schema
    composed = "allOf" in json.dumps(schema)
    return _close(schema, composed)


def _declares_every_required(schema: dict) -> bool:
    required, properties = schema.get("required"), schema.get("properties")
    return not isinstance(required, list) or all(name in properties for name in required if isinstance(name, str))


def _close(schema: Any, composed: bool, close_self: bool = True) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    is_object = isinstance(out.get("properties"), dict) or "required" in out
    if (close_self and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYWORDS)
            and not any(k in out for k in _MERGING_KEYWORDS) and _declares_every_required(out)):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict) and not (composed and key != "properties"):
            out[key] = {name: _close(value, composed) for name, value in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            # a union's members are whole objects and are closed each; members beside the object's
            # own properties or required keys add to that object, so they stay open
            members_open = key != "prefixItems" and is_object
            out[key] = [_close(value, composed, close_self=not members_open) for value in out[key]]
    if isinstance(out.get("items"), dict | list):
        items = out["items"]
        out["items"] = [_close(v, composed) for v in items] if isinstance(items, list) else _close(items, composed)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"], composed)
    return out


def forced_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool] | None:
    """The tools a call must be made to, or None when the output is free text. Raises ValueError
    (naming tool_choice) for a named function that was not declared."""
    if choice in (None, "none", "auto"):
        return None
    if not tools:
        raise ValueError("tool_choice: names a call but no tools are given")
    if choice == "required":
        return tools
    assert isinstance(choice, NamedToolChoice)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise ValueError(f"tool_choice: function {choice.function.name!r} is not among the tools")
    return named


def constraint(response_format: ResponseFormat | None, tools: list[Tool] | None) -> tuple[str, str]:
    """(kind, spec) for the worker's SamplingParams; ("", "") for free text."""
    if tools:
        return "json_schema", json.dumps(call_schema(tools))
    if response_format is None or response_format.type == "text":
        return "", ""
    if response_format.type == "json_object":
        return "json_object", ""
    assert response_format.json_schema is not None
    return "json_schema", json.dumps(response_format.json_schema.json_schema)


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The call a constrained generation wrote, as OpenAI's `tool_calls`; None if it is incomplete
    (the generation hit max_tokens before the call's JSON closed)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    return [_call(call["name"], json.dumps(call["arguments"]))]


# The start of a forced call's JSON (call_schema: "name" first, then "arguments"), cut off anywhere.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]*)(?P<closed>")?'
                        r'(?:\s*,\s*"arguments"\s*:\s*(?P<arguments>.*))?', re.DOTALL)


def partial_tool_calls(text: str, names: Iterable[str]) -> list[dict[str, Any]]:
    """A forced call cut off by max_tokens, as OpenAI answers one (finish_reason "length"): the
    call's name and its arguments as far as they were written (not valid JSON). The name is the one
    written, or the only declared name the cut-off text can still begin; [] when the text cannot
    tell which function it calls (never the envelope as content: that is our grammar's, not an
    answer)."""
    match = _CALL_HEAD.match(text)
    if match is None:  # cut off before the name began
        if not '{"name":"'.startswith("".join(text.split())):
            return []
        written = ""
    else:
        written = match["name"]
        if match["closed"]:
            return [_call(written, (match["arguments"] or "").rstrip())] if written in names else []
    candidates = sorted(n for n in names if n.startswith(written))
    return [_call(candidates[0], "")] if len(candidates) == 1 else []


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
