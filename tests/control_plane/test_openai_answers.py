"""Issue 17 (part): OpenAI's answers. Invalid bodies are 400s naming the parameter (the official
client raises BadRequestError, not UnprocessableEntityError); parameters this server does not serve
yet are refused instead of silently ignored, while their neutral values pass; values out of
OpenAI's (or vLLM's) range are refused; types are strict; an unknown model is `model_not_found`."""

from __future__ import annotations

import json

import pytest

from tests.control_plane.test_hardening import _post, gateway  # noqa: F401 (the fixture)


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),  # the deprecated form
    ("/v1/chat/completions", {"logit_bias": {"the": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"7": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 65, "n": 2}, "n"),  # 130 choices
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),  # strict types: no coercion
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
])
async def test_what_is_not_served_is_a_400_naming_it(gateway, path, extra, param):  # noqa: F811
    base = {"model": "m", "prompt": "hi"} if path == "/v1/completions" else \
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, answer = await _post(gateway, path, json.dumps({**base, **extra}), gateway.infer_key)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"]


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []}, {"logit_bias": {}},
    {"top_logprobs": 0}, {"parallel_tool_calls": True}, {"n": 1}, {"unknown_extra": 1},
    {"presence_penalty": -2}, {"frequency_penalty": 2}, {"repetition_penalty": 1.2}, {"min_tokens": 2},
    {"logit_bias": {"7": -100}}, {"logprobs": True, "top_logprobs": 20},
])
async def test_neutral_values_pass_validation(gateway, extra):  # noqa: F811
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    status, answer = await _post(gateway, "/v1/chat/completions", json.dumps(body), gateway.infer_key)
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer  # past validation


async def test_embeddings_of_an_unknown_model_are_a_404(gateway):  # noqa: F811
    """Served models and their kinds: tests/control_plane/test_embeddings_api.py."""
    status, answer = await _post(gateway, "/v1/embeddings", json.dumps({"model": "m", "input": "hi"}),
                                 gateway.infer_key)
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
