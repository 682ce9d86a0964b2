"""Anthropic's Messages API (`POST /v1/messages`) as a translation of chat completions.

Why a translation: a Messages request means what a chat completion means (system prompt, turns,
tools, stop sequences, sampling), so it is rewritten into a `ChatCompletionRequest` and served by
the same `Completions.chat`: the same keys, limits, flow control, routing, usage and structured
tool calls, with no second request path to keep in step. Only the shapes differ: the request's
content blocks, the answer's content blocks and stop reasons, the streamed events
(message_start, content_block_start/delta/stop, message_delta, message_stop) and the error body
({"type": "error", "error": {"type": ..., "message": ...}}), which is what the `anthropic` client reads.

Not carried: images and documents in content (400 naming the block), extended thinking (400 unless
disabled) and code-execution containers (400). A stop sequence that ends the answer is named in
`stop_sequence` with `stop_reason: "stop_sequence"` (the worker reports which stop string matched:
the chat choice's `stop_reason`). Where Anthropic runs a request (service_tier, speed,
inference_geo) and cache hints are accepted and not used: there is nothing here to choose.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferplane.control_plane.gateway.chat_stream import chat_stream_items
from inferplane.control_plane.gateway.errors import validation_message
from inferplane.control_plane.gateway.openai_types import UINT32_MAX, ChatCompletionRequest

# What the anthropic client raises by, per status (its errors' `type`).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "api_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class InvalidMessages(ValueError):
    """A Messages request that cannot be served: a 400 naming `param` (the field's path)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param

    @classmethod
    def of(cls, exc: ValidationError) -> InvalidMessages:
        """pydantic's first error, named as the OpenAI routes name it (errors.validation_message)."""
        message, param = validation_message(exc.errors())
        param = param or "body"
        return cls(param, message.removeprefix(f"{param}: "))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolSpec(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # prompt caching hints: the radix cache needs none


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # one call per answer either way


class MessageIn(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None  # structured output: the answer follows the schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no reasoning here to spend it on


class Thinking(_Strict):
    type: Literal["disabled"] = Field(description="extended thinking is not served: only 'disabled'")
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=UINT32_MAX)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    # The sampling fields clients of the API's earlier versions send (today's client: extra_body).
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[ToolSpec] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None  # user_id, for the caller's own records
    # Where and how Anthropic runs a request: nothing here to choose, so accepted and not used.
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None  # the radix cache keeps prefixes without hints
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def parse_request(raw: bytes) -> MessagesRequest:
    """The body as a MessagesRequest; `InvalidMessages` naming the first bad field."""
    try:
        data = json.loads(raw or b"null")
    except ValueError:
        raise InvalidMessages("body", "not JSON") from None
    if not isinstance(data, dict):
        raise InvalidMessages("body", "must be a JSON object")
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidMessages.of(exc) from None


def _text(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of text blocks (what a system prompt or a tool result carries)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise InvalidMessages(f"{where}[{j}].type", f"{block.get('type')!r} is not supported here (text only)")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _turns(request: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: a tool_use block becomes an assistant's tool call, a
    tool_result block a `tool` message answering it."""
    out: list[dict[str, Any]] = []
    if request.system is not None:
        out.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and message.role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": str(block.get("name", "")),
                                           "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": _text(content, f"{where}.content") if content else ""})
            else:
                raise InvalidMessages(f"{where}.type", f"{kind!r} is not supported in a {message.role} message")
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": "".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that means what `request` means."""
    body: dict[str, Any] = {"model": request.model, "max_tokens": request.max_tokens, "messages": _turns(request),
                            "temperature": request.temperature, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.top_p is not None:
        body["top_p"] = request.top_p
    if request.top_k:
        body["top_k"] = request.top_k
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    if request.output_config is not None and request.output_config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": request.output_config.format.schema_}}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                          "parameters": t.input_schema}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidMessages("tool_choice.name", "required with type 'tool'")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidMessages.of(exc) from None


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_use_id() -> str:
    """An id for a tool call that came without one (the chat path names each call it makes)."""
    return "toolu_" + secrets.token_hex(8)


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        arguments = call["function"].get("arguments") or "{}"
        try:
            tool_input = json.loads(arguments)
        except ValueError:
            tool_input = {"_arguments": arguments}  # what the model wrote, kept
        blocks.append({"type": "tool_use", "id": call.get("id") or _tool_use_id(),
                       "name": call["function"]["name"], "input": tool_input})
    return blocks


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice: which stop sequence ended it, if one did."""
    if choice.get("stop_reason"):
        return "stop_sequence", choice["stop_reason"]
    return STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"), None


def from_completion(completion: dict[str, Any], model: str) -> dict[str, Any]:
    """A chat completion (one choice) as a Messages answer."""
    choice = completion["choices"][0]
    usage = completion.get("usage") or {}
    reason, sequence = _stop(choice)
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model,
            "content": _blocks(choice["message"]),
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0)}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def stream_events(chunks: AsyncIterator[str | bytes], model: str) -> AsyncIterator[str]:
    """The chat completion's SSE chunks as Messages stream events: text as one text block, each
    tool call as a tool_use block with its arguments as input_json_delta, then the stop reason
    and usage. An error event of the chat stream becomes an `error` event."""
    yield _event("message_start", {"message": {
        "id": message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    index = -1  # the open content block's index (-1: none yet)
    open_kind: str | None = None
    open_call: int | None = None  # the OpenAI tool call index the open tool_use block is
    reason, sequence, usage = "end_turn", None, {"input_tokens": 0, "output_tokens": 0}

    def close() -> str:
        return _event("content_block_stop", {"index": index})

    async for chunk in chat_stream_items(chunks):
        if isinstance(chunk, str):
            yield _event("ping", {})  # the chat stream's keep-alive while queued
            continue
        if "error" in chunk:
            error = chunk["error"]
            status = {"rate_limit_exceeded": 429, "upstream_timeout": 504}.get(error.get("code"), 500)
            yield _event("error", {"error": error_body(status, error.get("message", "error"))["error"]})
            return
        if chunk.get("usage"):
            usage = {"input_tokens": chunk["usage"].get("prompt_tokens", 0),
                     "output_tokens": chunk["usage"].get("completion_tokens", 0)}
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if open_kind != "text":
                    if open_kind is not None:
                        yield close()
                    index, open_kind, open_call = index + 1, "text", None
                    yield _event("content_block_start", {"index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"index": index,
                                                     "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if open_kind != "tool_use" or call.get("index", 0) != open_call:
                    if open_kind is not None:
                        yield close()
                    index, open_kind, open_call = index + 1, "tool_use", call.get("index", 0)
                    yield _event("content_block_start", {"index": index, "content_block": {
                        "type": "tool_use", "id": call.get("id") or _tool_use_id(),
                        "name": function.get("name", ""), "input": {}}})
                if function.get("arguments"):
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                reason, sequence = _stop(choice)
    if open_kind is not None:
        yield close()
    yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage})
    yield _event("message_stop", {})
