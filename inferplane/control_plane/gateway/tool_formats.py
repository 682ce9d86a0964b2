"""`tool_choice: auto`: a chat template's own tool-call format, rendered and parsed back.

With `auto` the model decides whether to call. It can only do so in the format its chat template
taught it, so the gateway renders the tools through the template and parses calls in that format
out of the answer. One format is known: Hermes-style `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks, used by Qwen2/2.5/3, Hermes and many fine-tunes (their templates name the
tag). A template without a known format (SmolLM2's) cannot call: `auto` then answers as `none`,
as the README says. A forced call (`required` or a named function) needs no format: the output is
constrained to the call (structured_outputs.py).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from inferplane.control_plane.gateway.structured_outputs import partial_tool_calls, tool_calls

HERMES = "hermes"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches, or None when it teaches none we parse."""
    if chat_template and "<tool_call>" in chat_template:
        return HERMES
    return None


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as tool-aware templates read them (HF's convention): an assistant's earlier
    calls as `tool_calls` with arguments as objects, a tool result with its `tool_call_id`."""
    rendered = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text() if not message.tool_calls or
                                message.content else ""}
        if message.tool_calls:
            item["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template shows the string as it is
    return {"id": call.get("id"), "type": "function", "function": function}


def parse_calls(text: str, fmt: str | None, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an answer written in format `fmt`. A block that is not a JSON call
    to one of `names` (or is cut off before it closes) stays in the content as text."""
    if fmt != HERMES:
        return text, []
    calls, kept, last = [], [], 0
    for match in _HERMES_CALL.finditer(text):
        call = _call_object(match.group(1), names)
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call_object(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def held_answer(text: str, reason: str | None, *, forced: bool, fmt: str | None,
                names: set[str]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """(content, tool_calls, finish_reason) of an answer held back for its calls, as REST and gRPC
    both answer it.

    A forced call (`names`: the functions it may call): its JSON is the grammar's envelope, never an
    answer's text, so it is never content. Whole (the JSON closed), it is the call with reason
    "tool_calls"; cut off by max_tokens, it is answered as OpenAI answers a cut-off call: reason
    "length", the call with its arguments as far as they were written (partial_tool_calls), or no
    call when not even its function can be told; any other end (an error) keeps its reason and has
    no call. Otherwise calls in the template's format `fmt`; with none, the text as written and the
    reason unchanged."""
    if forced:
        calls = tool_calls(text) or []
        if calls:
            return None, calls, "tool_calls"
        return None, partial_tool_calls(text, names) if reason == "length" else [], reason
    content, calls = parse_calls(text, fmt, names)
    if not calls:
        return text, [], reason
    return content, calls, "tool_calls"
