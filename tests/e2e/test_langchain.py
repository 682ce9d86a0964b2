"""Issue 17: LangChain's OpenAI chat model against the gateway, as agent code uses it: `bind_tools`
returns tool calls whose arguments validate, and `with_structured_output` returns a validated
object. Skipped only when `langchain-openai` is not installed (it is in the test extras)."""

from __future__ import annotations

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.slow
langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=10)
    celsius: int = Field(ge=-40, le=50)


@pytest.fixture
def chat_model(in_process_gateway):
    from inferplane.control_plane.gateway.rest import create_asgi_app

    key = openai_client(in_process_gateway, "langchain").api_key  # a tenant and a key of its own
    transport = httpx.ASGITransport(create_asgi_app(in_process_gateway.context))
    return langchain_openai.ChatOpenAI(
        model="m", base_url="http://gw/v1", api_key=key, temperature=0.7, seed=3, max_tokens=200, timeout=300,
        http_async_client=httpx.AsyncClient(transport=transport, base_url="http://gw"))


async def test_bind_tools_returns_tool_calls_whose_arguments_validate(chat_model) -> None:
    model = chat_model.bind_tools([Weather], tool_choice="Weather", strict=True)
    message = await model.ainvoke("What is the weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    Weather.model_validate(call["args"])


async def test_with_structured_output_returns_a_validated_object(chat_model) -> None:
    structured = chat_model.with_structured_output(Weather)  # json_schema, strict: response_format
    answer = await structured.ainvoke("What is the weather in Oslo?")
    assert isinstance(answer, Weather)
    # strict: additionalProperties false (without it, the tiny model may add keys until max_tokens)
    tool_calling = chat_model.with_structured_output(Weather, method="function_calling", strict=True)
    assert isinstance(await tool_calling.ainvoke("And in Lima?"), Weather)
