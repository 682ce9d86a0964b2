"""OpenAI's Responses API (`POST /v1/responses`): the request, translated into a chat completion.

Why a translation: a Responses request means what a chat completion means (instructions as a system
message, input items as turns, function tools, a text format), so it is rewritten into a
`ChatCompletionRequest` and served by `Completions.chat`, as Anthropic's Messages API is
(anthropic_messages.py): the same keys, limits, flow control, routing, usage and structured tool
calls. The answer's shapes are responses_output.py's; storage and `previous_response_id` are the
route's (routes/responses.py, stored_responses.py).

As on the chat route, unknown fields are ignored, and the API's fields this server does not serve
(background, conversation, prompt, reasoning, include, top_logprobs, truncation "auto", ...) are a
400 naming them when they ask for something; their neutral values are accepted. Built-in tools
(web_search, file_search, ...) are a 400 naming `tools[i].type`; content other than text (images,
files, audio) a 400 naming `input[i].content[j].type`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from inferplane.control_plane.gateway.openai_types import UINT32_MAX, ChatCompletionRequest, lone_surrogate_at
from inferplane.control_plane.gateway.structured_outputs import FUNCTION_NAME

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
MAX_INPUT_ITEMS = 2048
# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512

# Fields of the API not served, with the values that ask for nothing (accepted).
UNSERVED: dict[str, tuple[Any, ...]] = {
    "background": (False,), "conversation": (), "prompt": (), "include": (), "reasoning": (),
    "truncation": ("disabled",), "top_logprobs": (0,), "context_management": (), "moderation": (),
    "image": (), "access_programs": (), "background_options": (), "prompt_cache_options": (),
}
# What a chat request's error names, as a Responses request names it (longest prefix first).
_CHAT_PARAMS = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("messages", "input"))


class InvalidRequest(ValueError):
    """A Responses request that cannot be served: OpenAI's 400 naming `param` (the field's path)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.code = code


def _path(loc: Sequence[Any], prefix: str = "") -> str:
    """pydantic's error location as OpenAI writes a field's path: `tools[0].name`."""
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _invalid(exc: ValidationError, prefix: str = "") -> InvalidRequest:
    first = exc.errors()[0]
    param = _path([p for p in first.get("loc", ()) if p != "body"], prefix)
    return InvalidRequest(param, first.get("msg", "invalid value"))


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class FunctionTool(_Base):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Base):
    format: TextFormat | None = None
    # How long GPT-5's answers run: no such knob here, so only OpenAI's default ("medium") is taken.
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_Base):
    model: str = Field(min_length=1)
    input: Any = Field(description="a string (one user message) or a list of input items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None  # one call per answer either way, as on the chat route
    store: bool | None = None  # None: true, OpenAI's default
    stream: bool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=64)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", "name": ...}: _check_tool_choice
    text: TextConfig | None = None
    # Where and how OpenAI runs a request, or what only its built-in tools use: nothing here to
    # choose, so accepted and not used (docs/responses.md).
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        if not value:
            raise ValueError("must not be an empty list")
        if len(value) > MAX_INPUT_ITEMS:
            raise ValueError(f"at most {MAX_INPUT_ITEMS} items")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value and len(value) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} key-value pairs")
        for key, item in (value or {}).items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"key {key[:20]!r}... is longer than {METADATA_KEY_CHARS} characters")
            if len(item) > METADATA_VALUE_CHARS:
                raise ValueError(f"the value of {key!r} is longer than {METADATA_VALUE_CHARS} characters")
        return value

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    def function_tools(self) -> list[FunctionTool]:
        """The tools, every one a function (parse_request checked)."""
        return [FunctionTool.model_validate(t) for t in self.tools or []]


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None or value in neutral:
        return True
    if isinstance(value, dict):
        return all(v is None for v in value.values())
    return isinstance(value, list) and not value


def parse_request(raw: bytes) -> ResponsesRequest:
    """The body as a ResponsesRequest; `InvalidRequest` naming the first bad field."""
    try:
        data = json.loads(raw or b"null")
    except ValueError:
        raise InvalidRequest("body", "request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body", "must be a JSON object")
    where = lone_surrogate_at(data)
    if where:
        path = _path([int(p) if p.isdigit() else p for p in where.split(".")])
        raise InvalidRequest(path, "not valid Unicode text (a lone UTF-16 surrogate)")
    for name, neutral in UNSERVED.items():
        if name in data and not _asks_nothing(data[name], neutral):
            raise InvalidRequest(name, "not supported by this server", "unsupported_parameter")
    try:
        request = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None
    for i, tool in enumerate(request.tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(f"tools[{i}].type", f"{kind!r} is not supported: only function tools are served "
                                 "(built-in tools such as web_search or file_search are not)", "unsupported_parameter")
        try:
            FunctionTool.model_validate(tool)
        except ValidationError as exc:
            raise _invalid(exc, f"tools[{i}]") from None
    _check_tool_choice(request.tool_choice)
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_schema" and (fmt.name is None or fmt.schema_ is None):
        raise InvalidRequest("text.format.name" if fmt.name is None else "text.format.schema",
                             "required with type json_schema")
    return request


def _check_tool_choice(choice: Any) -> None:
    if choice is None or choice in ("none", "auto", "required"):
        return
    if not isinstance(choice, dict):
        raise InvalidRequest("tool_choice", "must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                             "\"name\": ...}")
    if choice.get("type") != "function":
        raise InvalidRequest("tool_choice.type", f"{choice.get('type')!r} is not supported: give 'auto', 'none', "
                             "'required' or {\"type\": \"function\", \"name\": ...}", "unsupported_parameter")
    if not isinstance(choice.get("name"), str) or not choice["name"]:
        raise InvalidRequest("tool_choice.name", "required with type 'function'")


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message), as they are stored."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return list(request.input)


def _text(content: Any, where: str) -> str:
    """The text of a string or of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(where, "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise InvalidRequest(f"{where}[{j}].type", f"{kind!r} is not supported here (text only: "
                                 f"{', '.join(TEXT_PARTS)})", "unsupported_parameter")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}[{j}].text", "must be a string")
        parts.append(text)
    return "".join(parts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where}.{name}", "must be a non-empty string")
    return value


def append_turns(messages: list[dict[str, Any]], items: list[dict[str, Any]], where: str = "input") -> None:
    """Adds `items` to chat `messages`: a message item as a turn, a function_call as the assistant's
    call (joined to the assistant turn just before it, as chat writes text and calls in one turn),
    a function_call_output as the `tool` message answering it."""
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(at, "must be an object (an input item)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequest(f"{at}.role", f"must be one of {', '.join(ROLES)}")
            messages.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                raise InvalidRequest(f"{at}.arguments", "must be a string (the call's JSON arguments)")
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last.get("content") or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                             "content": _text(item.get("output"), f"{at}.output")})
        else:
            raise InvalidRequest(f"{at}.type", f"{kind!r} is not supported (message, function_call and "
                                 "function_call_output items are)", "unsupported_parameter")


def to_chat(request: ResponsesRequest, earlier: list[dict[str, Any]], items: list[dict[str, Any]]
            ) -> ChatCompletionRequest:
    """The chat completion request that means what `request` means, continuing the `earlier`
    conversation (a previous response's input and output items; its instructions are not carried
    over, as OpenAI does not carry them)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    append_turns(messages, earlier, "previous_response_id")
    append_turns(messages, items)
    body: dict[str, Any] = {"model": request.model, "messages": messages, "stream": request.streamed}
    if request.streamed:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("temperature", request.temperature), ("top_p", request.top_p),
                        ("max_completion_tokens", request.max_output_tokens), ("user", request.user),
                        ("parallel_tool_calls", request.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if request.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in request.function_tools()]
    if isinstance(request.tool_choice, dict):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice["name"]}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {}),
            **({"description": fmt.description} if fmt.description is not None else {})}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [p for p in first.get("loc", ()) if p != "body"]
        chat_param = ".".join(map(str, loc)) or (first.get("ctx") or {}).get("param")
        raise InvalidRequest(responses_param(chat_param) or "body",
                             responses_message(first.get("msg", "invalid value"), chat_param)) from None


def responses_param(param: str | None) -> str | None:
    """A chat request's field (an error's `param`) as the Responses request names it."""
    if not param:
        return param
    for chat, responses in _CHAT_PARAMS:
        if param.startswith(chat):
            return responses + param[len(chat):]
    if param.startswith("tools."):  # tools.0.function.name -> tools[0].name
        parts = param.split(".")
        if len(parts) >= 2 and parts[1].isdigit():
            rest = [p for p in parts[2:] if p != "function"]
            return f"tools[{parts[1]}]" + "".join(f".{p}" for p in rest)
    return param


def responses_message(message: str, chat_param: str | None) -> str:
    """An error message of the chat path naming `chat_param`, with that field named as the
    Responses request names it."""
    for chat, responses in _CHAT_PARAMS:
        if chat_param and chat_param.startswith(chat):
            return message.replace(chat.rstrip("."), responses.rstrip("."))
    return message
