"""Issue 17: every field of the OpenAI request models is honoured or refused, none silently ignored.

The fields are read from the pydantic models themselves, so a field added later fails here until
it is classified: carried to the worker (its non-default value changes the worker's sampling
parameters or the token budget), shaping the answer (checked by the tests named beside it), or
refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from inferplane.control_plane.gateway.openai_types import UNSERVED, ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {ChatCompletionRequest: {"model": "m", "messages": MESSAGES}, CompletionRequest: {"model": "m", "prompt": "hi"}}

# A non-default value for each field the worker receives.
CARRIED: dict[str, Any] = {
    "max_tokens": 7, "max_completion_tokens": 7, "temperature": 0.3, "top_p": 0.5, "top_k": 5, "stop": ["x"],
    "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3,
    "logit_bias": {"1": 2.0}, "min_tokens": 2, "ignore_eos": True, "min_p": 0.1, "logprobs": None, "top_logprobs": 2,
    "response_format": {"type": "json_object"},
    "tool_choice": "required", "n": 3,
    "structured_outputs": {"regex": "[0-9]+"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_json": {"type": "object"},
}
# Fields that shape the answer rather than the sampling, and where that is tested.
SHAPING = {
    "model": "routing and the catalog (tests/control_plane/test_routing_*.py)",
    "messages": "the prompt, through the chat template (tests/e2e/test_platform_openai.py)",
    "prompt": "the prompt (tests/e2e/test_platform_openai.py)",
    "stream": "server-sent events (tests/e2e/test_platform_openai.py)",
    "stream_options": "the usage chunk (tests/e2e/test_platform_openai.py)",
    "tools": "the functions tool_choice may force (tests/e2e/test_structured_outputs.py)",
    "parallel_tool_calls": "one call per answer either way (README: differs from OpenAI)",
    "chat_template_kwargs": "the prompt, as the chat template's variables (tests/control_plane/test_openai_answers.py)",
    "user": "OpenAI's end-user id for abuse monitoring; no effect on the output in OpenAI either",
    "echo": "the prompt first in the answer, with its logprobs if asked (tests/e2e/test_openai_sampling.py)",
}
REFUSED: dict[str, Any] = {name: "x" for name in UNSERVED}


def worker_view(model: type, body: dict) -> tuple:
    request = model.model_validate(body)
    return request.asked_max_tokens(), request.sampling_params(16).SerializeToString()


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=lambda m: m.__name__)
def test_every_field_is_classified(model: type) -> None:
    unclassified = set(model.model_fields) - set(CARRIED) - set(SHAPING)
    assert unclassified == set(), f"classify these fields of {model.__name__}: {sorted(unclassified)}"


@pytest.mark.parametrize(("model", "field"), [
    (m, f) for m in (ChatCompletionRequest, CompletionRequest) for f in CARRIED if f in m.model_fields])
def test_a_carried_field_changes_what_the_worker_gets(model: type, field: str) -> None:
    base = dict(BASE[model])
    value = CARRIED[field]
    if field == "logprobs":
        value = True if model is ChatCompletionRequest else 2
    if field == "top_logprobs":
        base["logprobs"] = True
    if field == "tool_choice":
        base["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert worker_view(model, {**base, field: value}) != worker_view(model, base), field


@pytest.mark.parametrize(("model", "field"), [
    (m, f) for m in (ChatCompletionRequest, CompletionRequest) for f in REFUSED
    if f in m.model_fields or f in UNSERVED])
def test_a_refused_field_is_an_error_naming_it(model: type, field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        model.model_validate({**BASE[model], field: REFUSED[field]})
    named = {str(e["loc"][0]) for e in refused.value.errors() if e["loc"]} | \
        {(e.get("ctx") or {}).get("param") for e in refused.value.errors()}
    assert field in named, refused.value.errors()
