"""OpenAI's Responses API: a chat completion's answer as a Response object, and its stream as
Responses stream events (the request side is responses_request.py).

The shapes are the ones the `openai` client parses (openai/types/responses/): an answer's text is an
output `message` item with one `output_text` part, each tool call a `function_call` item; a
finish by max_output_tokens makes the response `incomplete` (incomplete_details.reason
"max_output_tokens"), and its last item `incomplete`. A stream is response.created,
response.in_progress, then per item output_item.added, its content (content_part.added,
output_text.delta..., output_text.done, content_part.done; or function_call_arguments.delta...,
function_call_arguments.done), output_item.done, and last response.completed (or
response.incomplete), every event numbered by `sequence_number` from 0. A stream that breaks after
it started ends with an `error` event and response.failed.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from inferplane.control_plane.gateway.chat_stream import chat_stream_items
from inferplane.control_plane.gateway.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    """An id as OpenAI's look: resp_..., msg_..., fc_..."""
    return f"{prefix}_{secrets.token_hex(24)}"


def skeleton(request: ResponsesRequest, response_id: str, created_at: int) -> dict[str, Any]:
    """The Response as it is before any output: the request's settings as they are applied."""
    fmt = request.text.format if request.text is not None else None
    choice = request.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "metadata": request.metadata or {},
        "model": request.model, "output": [], "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id, "store": request.stored,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": {"type": "function", "name": choice["name"]} if isinstance(choice, dict) else choice or "auto",
        "tools": [t.model_dump() for t in request.function_tools()],
        "truncation": "disabled", "usage": None, "user": request.user, "completed_at": None,
    }


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat completion's usage as a Response's. No reasoning here, and no cache writes counted
    apart from input (the prefix cache keeps prompts without a separate charge): both 0."""
    chat_usage = chat_usage or {}
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def finished(base: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None,
             chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """The whole Response: `completed`, or `incomplete` when max_output_tokens ended it."""
    response = {**base, "output": output, "usage": usage(chat_usage), "completed_at": int(time.time())}
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    return response


def from_completion(completion: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (one choice) as the Response `base` becomes."""
    choice = completion["choices"][0]
    message, reason = choice["message"], choice.get("finish_reason")
    status = _item_status(reason)
    calls = message.get("tool_calls") or []
    output = []
    if message.get("content") is not None or not calls:
        output.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in calls:
        output.append(call_item(new_id("fc"), call.get("id") or new_id("call"), call["function"]["name"],
                                call["function"].get("arguments") or "", status))
    return finished(base, output, reason, completion.get("usage"))


class ResponseEvents:
    """One stream's events, numbered as they go; `final` is the whole Response once it is complete
    (set before its response.completed or response.incomplete event is yielded, so a caller can
    store it first), and stays None for a stream that failed."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.final: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None  # the item being written
        self._open_call: int | None = None  # the chat tool call index the open function_call is
        self._text: list[str] = []

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, **data, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _index(self) -> int:
        return len(self.output)

    def _open_text(self) -> list[str]:
        item = message_item(new_id("msg"), None, "in_progress")
        self._open, self._open_call, self._text = item, None, []
        return [self.event("response.output_item.added", output_index=self._index(), item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                           content_index=0, part=_text_part(""))]

    def _open_function(self, call: dict[str, Any]) -> list[str]:
        function = call.get("function") or {}
        item = call_item(new_id("fc"), call.get("id") or new_id("call"), function.get("name", ""), "", "in_progress")
        self._open, self._open_call = item, call.get("index", 0)
        return [self.event("response.output_item.added", output_index=self._index(), item=item)]

    def _close(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, events = self._index(), []
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self._text)
            item["content"] = [_text_part(text)]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=_text_part(text))]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def failure(self, code: str | None, message: str, param: str | None = None) -> list[str]:
        """The events a stream that cannot finish ends with: `error`, then response.failed."""
        failed = {**self.base, "status": "failed", "output": self.output,
                  "error": {"code": "rate_limit_exceeded" if code == "rate_limit_exceeded" else "server_error",
                            "message": message}}
        return [self.event("error", code=code, message=message, param=param),
                self.event("response.failed", response=failed)]

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        """The chat completion's SSE chunks (with a usage chunk) as Responses events. The chat
        stream's keep-alive comments while the request is queued pass through as comments."""
        yield self.event("response.created", response=self.base)
        yield self.event("response.in_progress", response=self.base)
        reason: str | None = "stop"
        chat_usage: dict[str, Any] | None = None
        async for chunk in chat_stream_items(chunks):
            if isinstance(chunk, str):
                yield chunk  # a keep-alive comment
                continue
            if "error" in chunk:
                error = chunk["error"]
                for event in self.failure(error.get("code"), error.get("message", "error"), error.get("param")):
                    yield event
                return
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                for event in self._delta(choice.get("delta") or {}):
                    yield event
                if choice.get("finish_reason"):
                    reason = choice["finish_reason"]
        if self._open is None and not self.output:  # an empty answer: one empty message, as whole
            for event in self._open_text():
                yield event
        for event in self._close(_item_status(reason)):
            yield event
        self.final = finished(self.base, self.output, reason, chat_usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        yield self.event(kind, response=self.final)

    def _delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                events += self._close("completed") + self._open_text()
            self._text.append(delta["content"])
            events.append(self.event("response.output_text.delta", item_id=self._open["id"],
                                     output_index=self._index(), content_index=0, delta=delta["content"],
                                     logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if self._open is None or self._open["type"] != "function_call" or call.get("index", 0) != self._open_call:
                events += self._close("completed") + self._open_function(call)
            arguments = (call.get("function") or {}).get("arguments")
            if arguments:
                self._open["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=self._index(), delta=arguments))
        return events
