"""Issue 17: structured outputs and tool calls through the official `openai` client, gateway and
worker: the answers parse and validate against their schemas (jsonschema), for 20 schemas drawn by
hypothesis on the tiny model and one on SmolLM2; forced tool calls come back as `tool_calls` whose
arguments validate, streamed and not; a schema the grammar engine rejects is a 400."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI

from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.gateway_harness import free_port, start_worker, wait_serving
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.control_plane.routing import Deployment, StaticEndpointSource
from inferplane.worker.model.tokenizer import load_gguf_tokenizer
from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Answer in JSON"}]
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.lists(NAMES, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        st.integers(1, 3).map(lambda n: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "minItems": 1, "maxItems": n}),
    )


def objects(values: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.dictionaries(NAMES, values, min_size=1, max_size=4).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})


SCHEMAS = objects(st.one_of(leaf(), objects(leaf())))


def draw_schemas(count: int) -> list[dict]:
    """`count` distinct schemas, the same on every run (derandomized)."""
    drawn: list[dict] = []

    @settings(max_examples=count * 3, deadline=None, database=None, derandomize=True)
    @given(SCHEMAS)
    def collect(schema: dict) -> None:
        if schema not in drawn:
            drawn.append(schema)

    collect()
    return drawn[:count]


@pytest.fixture
def client(in_process_gateway) -> AsyncOpenAI:
    return openai_client(in_process_gateway, "so")


async def test_twenty_drawn_schemas_are_followed(client) -> None:
    schemas = draw_schemas(20)
    assert len(schemas) == 20
    for schema in schemas:
        answer = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=150, temperature=0.8, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


async def test_json_object_mode_answers_an_object(client) -> None:
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=120, temperature=0,
                                                  response_format={"type": "json_object"})
    text = answer.choices[0].message.content
    if answer.choices[0].finish_reason == "stop":  # an open-ended object may run to max_tokens
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"regex": "[A-Z][a-z]{2,5} [0-9]{2}"}},
     lambda t: re.fullmatch("[A-Z][a-z]{2,5} [0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["n"], "additionalProperties": False}},
     lambda t: 0 <= json.loads(t)["n"] <= 9),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_vllms_structured_output_extensions_hold(client, extra, check, endpoint) -> None:
    """vLLM's `structured_outputs` (and the older `guided_*`), as its users send them: extra_body."""
    if endpoint == "chat":
        answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=30, temperature=1.0,
                                                      seed=11, n=2, extra_body=extra)
        texts = [c.message.content for c in answer.choices]
    else:
        answer = await client.completions.create(model="m", prompt="Say:", max_tokens=30, temperature=1.0, seed=11,
                                                 n=2, extra_body=extra)
        texts = [c.text for c in answer.choices]
    assert all(c.finish_reason == "stop" for c in answer.choices), texts
    assert all(check(t) for t in texts), texts


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"guided_regex": "(unclosed"}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
])
async def test_bad_extension_constraints_are_a_400_naming_the_parameter(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert refused.value.body["param"] == param, refused.value.body


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_forced_tool_calls_come_back_as_valid_tool_calls(client, choice) -> None:
    answer = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100, temperature=0.7,
                                                  seed=3, tools=[WEATHER, TIME], tool_choice=choice)
    choice_out = answer.choices[0]
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    (call,) = choice_out.message.tool_calls
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), BY_NAME[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"


async def test_a_streamed_tool_call_arrives_whole(client) -> None:
    stream = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=100, temperature=0,
                                                  tools=[WEATHER], tool_choice="required", stream=True)
    calls, reasons = [], []
    async for chunk in stream:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    (call,) = calls
    assert call.function.name == "get_weather" and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), BY_NAME["get_weather"])


async def test_tool_results_in_the_conversation_are_accepted(client) -> None:
    answer = await client.chat.completions.create(model="m", max_tokens=5, temperature=0, tools=[WEATHER], messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees"}])
    assert answer.choices[0].message.tool_calls is None  # tool_choice auto: these models write text


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
async def test_bad_constraints_are_a_400_naming_the_parameter(client, extra, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, **extra)
    assert refused.value.body["param"] == param, refused.value.body


async def test_smollm2_follows_a_schema(tmp_path) -> None:
    gguf = builtin_model_path("smollm2-135m")
    port = free_port()
    worker = start_worker(str(gguf), port, "--max-model-len", "512", "--kv-cache-memory", "64Mi",
                          log_path=str(tmp_path / "worker.log"))
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    try:
        wait_serving(f"127.0.0.1:{port}", worker, timeout=600)
        from gguf import GGUFReader

        tokenizer = load_gguf_tokenizer(GGUFReader(str(gguf)))
        gw.catalog.put(ServedModel(name="smol", tokenizer=tokenizer, max_model_len=512))
        gw.router.set_route("smol", [Deployment("d", StaticEndpointSource([f"127.0.0.1:{port}"]))])
        client = openai_client(gw, "so")
        properties = {"capital": {"type": "string", "maxLength": 20},
                      "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}}
        schema = {"type": "object", "properties": properties, "required": sorted(properties),
                  "additionalProperties": False}
        answer = await client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=80,
            temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    finally:
        worker.kill()
        worker.wait()
        gw.engine.dispose()


# A template with a Hermes-style tool-call format (as Qwen2.5's has): tools are rendered into the
# prompt (names only here: the tiny model's 256-token context) and calls come back as
# <tool_call>{...}</tool_call> blocks.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
    " as <tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# The tiny model cannot decide to call; a regex makes it write the call in the template's format.
HERMES_CALL = r'<tool_call>\{"name":"get_weather","arguments":\{"city":"Oslo","unit":"celsius"\}\}</tool_call>'


@pytest.fixture
def hermes_client(in_process_gateway, tiny_worker) -> AsyncOpenAI:
    import dataclasses

    model, address = tiny_worker
    tokenizer = dataclasses.replace(in_process_gateway.catalog.get("m", None).tokenizer, chat_template=HERMES_TEMPLATE)
    in_process_gateway.catalog.put(ServedModel(name="h", tokenizer=tokenizer, max_model_len=256))
    in_process_gateway.router.set_route("h", [Deployment("d", StaticEndpointSource([address]))])
    return openai_client(in_process_gateway, "hermes")


async def test_tool_choice_auto_parses_calls_in_the_templates_format(hermes_client) -> None:
    forced = {"structured_outputs": {"regex": HERMES_CALL}}
    answer = await hermes_client.chat.completions.create(model="h", messages=MESSAGES, max_tokens=120, temperature=0,
                                                         tools=[WEATHER, TIME], extra_body=forced)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}
    # The tools were rendered into the prompt (the template shows them only when given).
    bare = await hermes_client.chat.completions.create(model="h", messages=MESSAGES, max_tokens=1)
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + len("get_weather,get_time")
    # tool_choice none: nothing rendered, nothing parsed.
    none = await hermes_client.chat.completions.create(model="h", messages=MESSAGES, max_tokens=120, temperature=0,
                                                       tools=[WEATHER], tool_choice="none", extra_body=forced)
    assert none.choices[0].message.tool_calls is None and none.usage.prompt_tokens == bare.usage.prompt_tokens
    assert none.choices[0].message.content.startswith("<tool_call>")

    stream = await hermes_client.chat.completions.create(model="h", messages=MESSAGES, max_tokens=120, temperature=0,
                                                         tools=[WEATHER], extra_body=forced, stream=True)
    deltas = [c.choices[0] async for c in stream if c.choices]
    calls = [d.delta.tool_calls for d in deltas if d.delta.tool_calls]
    assert len(calls) == 1 and calls[0][0].function.name == "get_weather"
    assert deltas[-1].finish_reason == "tool_calls"

    # The call and its result go back into the conversation as the template reads them.
    follow = await hermes_client.chat.completions.create(model="h", max_tokens=3, temperature=0, tools=[WEATHER],
                                                         messages=[*MESSAGES, choice.message.model_dump(
                                                             exclude_none=True), {"role": "tool",
                                                             "tool_call_id": call.id, "content": "-3"}])
    assert follow.usage.prompt_tokens > answer.usage.prompt_tokens


async def test_the_grpc_api_parses_auto_calls_too(hermes_client, grpc_stub) -> None:
    from inferplane.v1 import inference_pb2, worker_pb2

    stub, key = grpc_stub
    request = inference_pb2.ChatRequest(
        model="h", messages=[worker_pb2.ChatMessage(role="user", content="weather?")],
        params=worker_pb2.SamplingParams(max_tokens=120, temperature=0, constraint_kind="regex",
                                         constraint_spec=HERMES_CALL),
        tools=[inference_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER["function"]["parameters"]))])
    finals = [out async for out in stub.Chat(request, metadata=key, timeout=120) if out.finished]
    assert finals[0].finish_reason == "tool_calls" and finals[0].text == ""
    assert json.loads(finals[0].tool_calls[0].arguments_json) == {"city": "Oslo", "unit": "celsius"}
