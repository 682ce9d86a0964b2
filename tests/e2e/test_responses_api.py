"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client, against a gateway
process (its SQLite database) and a real tiny-model worker.

The same request path as chat completions: a greedy answer is the chat completion's text, streamed
or not, and a continued conversation (`previous_response_id`) is the chat completion of the whole
conversation; forced function tools come back as function_call items and their output goes back as
function_call_output; a JSON schema is followed; stored answers are their tenant's alone; bad input
is a 400 naming the field.
"""

from __future__ import annotations

import json

import openai
import pytest

from inferplane.bench.gateway_harness import SERVED_MODEL
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with single_worker_gateway(tmp_path_factory, max_num_seqs=8, gateway_extra=("--tenant", "other")) as running:
        yield running.gateway


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.key, max_retries=0, timeout=120)


def test_an_answer_is_the_chat_completions_streamed_or_not_and_stored(client) -> None:
    reply = client.responses.create(model=SERVED_MODEL, instructions="Be brief.", input="Say something.",
                                    temperature=0, max_output_tokens=12, metadata={"run": "1"})
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == SERVED_MODEL
    assert reply.status in ("completed", "incomplete") and [i.type for i in reply.output] == ["message"]
    assert reply.metadata == {"run": "1"} and reply.store is True and reply.temperature == 0
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.input_tokens_details.cached_tokens >= 0
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    chat = client.chat.completions.create(model=SERVED_MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].finish_reason == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"

    with client.responses.stream(model=SERVED_MODEL, instructions="Be brief.", input="Say something.",
                                 temperature=0, max_output_tokens=12) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response() if reply.status == "completed" else None
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if reply.status == "completed" else "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    raw = list(client.responses.create(model=SERVED_MODEL, instructions="Be brief.", input="Say something.",
                                       temperature=0, max_output_tokens=12, stream=True))
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    last = raw[-1].response
    assert last.output_text == reply.output_text and last.usage.output_tokens == reply.usage.output_tokens
    if final is not None:
        assert final.output_text == reply.output_text
    # a streamed answer is stored before its last event: retrievable at once
    assert client.responses.retrieve(last.id).output_text == reply.output_text

    fetched = client.responses.retrieve(reply.id)
    assert fetched.id == reply.id and fetched.output_text == reply.output_text and fetched.metadata == {"run": "1"}
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(reply.id)
    unstored = client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_stored_conversation(client) -> None:
    first = client.responses.create(model=SERVED_MODEL, input="Name a colour.", temperature=0, max_output_tokens=6)
    second = client.responses.create(model=SERVED_MODEL, previous_response_id=first.id, input="Another one.",
                                     temperature=0, max_output_tokens=6)
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(model=SERVED_MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one."}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    # a chain goes on from its latest response, whose conversation holds every earlier turn
    third = client.responses.create(model=SERVED_MODEL, previous_response_id=second.id, input="And?",
                                    max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_forced_function_tools_are_function_call_items_and_their_output_follows(client) -> None:
    reply = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice=FORCED, max_output_tokens=64)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert reply.tool_choice.name == "get_weather" and reply.tools[0].name == "get_weather"

    with client.responses.stream(model=SERVED_MODEL, input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=64) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.name == "get_weather" and isinstance(json.loads(streamed.arguments)["city"], str)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds

    # the tool's output goes back as a function_call_output answering the call, in the stored conversation
    followed = client.responses.create(model=SERVED_MODEL, previous_response_id=reply.id, tools=[WEATHER],
                                       input=[{"type": "function_call_output", "call_id": call.call_id,
                                               "output": "Sunny, 21 C"}], max_output_tokens=8)
    assert followed.status in ("completed", "incomplete") and followed.usage.input_tokens > reply.usage.input_tokens
    # and as items sent whole, without a stored conversation
    whole = client.responses.create(model=SERVED_MODEL, tools=[WEATHER], store=False, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert whole.usage.input_tokens == followed.usage.input_tokens


def test_a_json_schema_is_followed(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    reply = client.responses.create(model=SERVED_MODEL, input="2+2?", max_output_tokens=48, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert reply.text.format.type == "json_schema"
    if reply.status == "completed":  # a tiny random model may run out of tokens inside a number
        answer = json.loads(reply.output_text)
        assert set(answer) == {"answer"} and isinstance(answer["answer"], int)
    else:
        assert reply.output_text.lstrip().startswith("{")


def test_another_tenant_cannot_retrieve_delete_or_continue_a_response(gateway, client) -> None:
    mine = client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=2)
    other = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.keys["other"], max_retries=0, timeout=120)
    unknown = "resp_" + "0" * 48
    for response_id in (mine.id, unknown):  # the same 404 for another tenant's id as for an unknown one
        with pytest.raises(openai.NotFoundError) as retrieved:
            other.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError) as deleted:
            other.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError) as continued:
            other.responses.create(model=SERVED_MODEL, previous_response_id=response_id, input="Go on.",
                                   max_output_tokens=2)
        assert retrieved.value.body["message"] == f"Response with id {response_id!r} not found."
        assert deleted.value.body["message"] == retrieved.value.body["message"]
        assert continued.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its tenant


def test_bad_input_gets_openais_400_naming_the_field(client) -> None:
    def refused(**body) -> dict:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{"model": SERVED_MODEL, "input": "Hi", **body})
        assert caught.value.body["type"] == "invalid_request_error"
        return caught.value.body

    assert refused(max_output_tokens=0)["param"] == "max_output_tokens"
    assert refused(tools=[{"type": "web_search"}])["param"] == "tools[0].type"
    assert refused(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png",
                                                       "detail": "auto"}]}])["param"] == "input[0].content[0].type"
    assert refused(reasoning={"effort": "high"})["code"] == "unsupported_parameter"
    assert refused(extra_body={"temperature": 9})["param"] == "temperature"
    # a limit the chat path checks (the context), named as the Responses request names it
    error = refused(max_output_tokens=100_000)
    assert error["param"] == "max_output_tokens" and "max_output_tokens" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
