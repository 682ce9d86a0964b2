"""Chat completion streams as the gateway's chat path writes them, for the tests of the APIs
translated from it (Anthropic's Messages, OpenAI's Responses)."""

from __future__ import annotations

import json


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def text_then_tool_call() -> tuple[str, ...]:
    """A keep-alive comment, "Hello" in two deltas (the second split mid-event), a call of `f` with
    its arguments in two pieces, the finish, the usage chunk and [DONE]."""
    second = sse({"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]})
    return (
        ": queued\n\n",
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}),
        second[:10], second[10:],
        sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": '{"x"'}}]}}]}),
        sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]}),
        sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}), "data: [DONE]\n\n")
