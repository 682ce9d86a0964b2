"""Issue 17 (part): OpenAI's answers. Invalid bodies are 400s naming the parameter (the official
client raises BadRequestError, not UnprocessableEntityError); parameters this server does not serve
yet are refused instead of silently ignored, while their neutral values pass; values out of
OpenAI's (or vLLM's) range are refused; types are strict; an unknown model is `model_not_found`."""

from __future__ import annotations

import json

import pytest

from inferplane.api.tokenizer import TextTokenizer
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.v1 import worker_pb2
from tests.control_plane.test_gateway_loop import byte_tokenizer
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
    ("/v1/chat/completions", {"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": [{"enable_thinking": False}]}, "chat_template_kwargs"),
    # the renderer's own variables are the server's (issue 30)
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False, "bos_token": "<x>"}},
     "chat_template_kwargs.bos_token"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
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
    {"chat_template_kwargs": {"enable_thinking": False, "custom": {"a": [1, None]}}}, {"chat_template_kwargs": None},
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


SWITCH_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
                   "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


async def test_chat_template_kwargs_reach_the_template(gateway):  # noqa: F811
    """vLLM's `chat_template_kwargs` become template variables of the prompt the gateway renders
    (Qwen3's thinking switch here); without them the template renders as before."""
    tokenizer: TextTokenizer = byte_tokenizer()
    tokenizer.chat_template = SWITCH_TEMPLATE
    gateway.catalog.put(ServedModel(name="m", tokenizer=tokenizer, max_model_len=4096))
    prompts: list[str] = []

    async def worker(prepared):  # stands in for the replica: notes the prompt it would get
        prompts.append(tokenizer.decode(prepared.token_ids, skip_special_tokens=False))
        yield worker_pb2.GenerateResponse(text="4", token_ids=[20], finished=True, finish_reason="stop",
                                          usage=worker_pb2.Usage(completion_tokens=1))

    gateway.context.inference.stream = worker
    base = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4}
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        status, answer = await _post(gateway, "/v1/chat/completions", json.dumps({**base, **extra}),
                                     gateway.infer_key)
        assert status == 200 and answer["choices"][0]["message"]["content"] == "4", answer
    assert prompts == ["<|user|>2+2?<|assistant|><think>\n\n</think>\n\n", "<|user|>2+2?<|assistant|>",
                       "<|user|>2+2?<|assistant|>"]
