"""Issue 59: Anthropic's Messages API (`/v1/messages`) through the official `anthropic` client,
against a gateway process and a real tiny-model worker.

The same request path as chat completions: a greedy answer is the chat completion's text, streamed
or not; tools come back as tool_use blocks; the stop reasons, usage and error shapes are the ones
the client reads (its exception classes by status, the body's error type naming the field).
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from inferplane.bench.gateway_harness import SERVED_MODEL
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with single_worker_gateway(tmp_path_factory, max_num_seqs=8) as running:
        yield running.gateway


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.key, max_retries=0, timeout=120)


def test_an_answer_is_the_chat_completions_streamed_or_not(gateway, client) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    greedy = {"temperature": 0}  # a sampling field of the API's earlier versions: today's client sends it so
    reply = client.messages.create(model=SERVED_MODEL, max_tokens=12, system="Be brief.", messages=messages,
                                   extra_body=greedy)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == SERVED_MODEL
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 12
    chat = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.key, max_retries=0).chat.completions.create(
        model=SERVED_MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *messages])
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens

    with client.messages.stream(model=SERVED_MODEL, max_tokens=12, system="Be brief.", messages=messages,
                                extra_body=greedy, service_tier="auto", metadata={"user_id": "u-1"}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text
    assert final.stop_reason == reply.stop_reason and final.usage.output_tokens == reply.usage.output_tokens

    # a bearer token (the client's auth_token) is the same key
    bearer = anthropic.Anthropic(base_url=gateway.base_url, auth_token=gateway.key, max_retries=0, timeout=120)
    assert bearer.messages.create(model=SERVED_MODEL, max_tokens=2, messages=messages).usage.output_tokens > 0


def test_max_tokens_and_a_multi_turn_conversation(client) -> None:
    reply = client.messages.create(model=SERVED_MODEL, max_tokens=3, extra_body={"temperature": 0.8, "top_p": 0.95},
                                   stop_sequences=["\n\n"], messages=[
                                       {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                                       {"role": "assistant", "content": "Hello."},
                                       {"role": "user", "content": "Go on."}])
    assert reply.usage.output_tokens <= 3
    if reply.usage.output_tokens == 3:
        assert reply.stop_reason == "max_tokens"


def test_tools_come_back_as_tool_use_blocks(client) -> None:
    reply = client.messages.create(model=SERVED_MODEL, max_tokens=64, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and isinstance(call.input["city"], str)
    assert reply.stop_reason == "tool_use"
    with client.messages.stream(model=SERVED_MODEL, max_tokens=64, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and isinstance(streamed.input["city"], str)
    # the tool's result goes back as a tool_result block answering the call
    followed = client.messages.create(model=SERVED_MODEL, max_tokens=8, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert followed.usage.input_tokens > reply.usage.input_tokens


def test_output_config_format_gives_json_that_follows_the_schema(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    reply = client.messages.create(model=SERVED_MODEL, max_tokens=48, messages=[{"role": "user", "content": "2+2?"}],
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    if reply.stop_reason == "end_turn":  # a tiny random model may run out of tokens inside a number
        answer = json.loads(reply.content[0].text)
        assert set(answer) == {"answer"} and isinstance(answer["answer"], int)
    else:
        assert reply.content[0].text.lstrip().startswith("{")


def test_bad_input_gets_anthropics_errors_naming_the_field(gateway, client) -> None:
    def refused(error_class, **body) -> dict:
        with pytest.raises(error_class) as caught:
            client.messages.create(**{"model": SERVED_MODEL, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hi"}], **body})
        assert caught.value.body["type"] == "error"
        return caught.value.body["error"]

    error = refused(anthropic.BadRequestError, max_tokens=0)
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    error = refused(anthropic.BadRequestError, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "messages[0].content[0].type" in error["message"]
    error = refused(anthropic.BadRequestError, extra_body={"temperature": 1.5})
    assert "temperature" in error["message"]
    error = refused(anthropic.BadRequestError, extra_body={"no_such_field": 1})
    assert "no_such_field" in error["message"]
    error = refused(anthropic.BadRequestError, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in error["message"]
    assert refused(anthropic.NotFoundError, model="no-such-model")["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=gateway.base_url, api_key="ip_nope_nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=SERVED_MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_stop_sequence_that_ends_the_answer_is_named(gateway, client) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    greedy = {"temperature": 0}
    free = client.messages.create(model=SERVED_MODEL, max_tokens=16, messages=messages, extra_body=greedy)
    text = free.content[0].text
    assert free.stop_sequence is None and len(text) >= 6
    stop = text[3:5]  # in the answer, past its start: the answer ends where it begins
    reply = client.messages.create(model=SERVED_MODEL, max_tokens=16, messages=messages, extra_body=greedy,
                                   stop_sequences=["never-there", stop])
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    answer = "".join(block.text for block in reply.content if block.type == "text")
    assert answer == text[:text.index(stop)]  # nothing of the stop sequence leaks, even where it begins
    with client.messages.stream(model=SERVED_MODEL, max_tokens=16, messages=messages, extra_body=greedy,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    # the chat completion names it too (vLLM's stop_reason), and leaves the field out otherwise
    chat = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.key, max_retries=0)
    stopped = chat.chat.completions.create(model=SERVED_MODEL, max_tokens=16, temperature=0, messages=messages,
                                           stop=[stop])
    assert stopped.choices[0].model_extra.get("stop_reason") == stop
    unstopped = chat.chat.completions.create(model=SERVED_MODEL, max_tokens=16, temperature=0, messages=messages)
    assert "stop_reason" not in unstopped.choices[0].model_extra
