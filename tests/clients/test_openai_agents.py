"""The OpenAI Agents SDK against a live daemon through both of its model classes (Chat
Completions and Responses): a run's final output and usage, typed output, a
`function_tool` it calls with the parsed arguments, and streamed text events."""

from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from tests.clients.models import WEATHER_ASK, WHERE, City, paris
from tests.daemon import Daemon

KINDS = ["chat", "responses"]
GREEDY = ModelSettings(max_tokens=80, temperature=0)


@pytest.fixture(autouse=True, scope="module")
def _no_tracing() -> None:
    set_tracing_disabled(True)  # its exporter would post to api.openai.com


def model(daemon: Daemon, kind: str, name: str) -> Model:
    client = AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    if kind == "chat":
        return OpenAIChatCompletionsModel(model=name, openai_client=client)
    return OpenAIResponsesModel(model=name, openai_client=client)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_answers_and_counts_usage(daemon: Daemon, kind: str) -> None:
    agent = Agent(name="a", model=model(daemon, kind, "qwen"), model_settings=GREEDY)
    result = asyncio.run(Runner.run(agent, "Say hello."))
    assert isinstance(result.final_output, str)
    assert result.final_output.strip()
    usage = result.context_wrapper.usage
    assert usage.requests == 1
    assert usage.input_tokens > 10
    assert 0 < usage.output_tokens < 80
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_typed_output(daemon: Daemon, kind: str) -> None:
    agent = Agent(
        name="a", model=model(daemon, kind, "qwen"), output_type=City, model_settings=GREEDY
    )
    city = asyncio.run(Runner.run(agent, WHERE)).final_output
    assert isinstance(city, City)
    paris(city)


@pytest.mark.parametrize("kind", KINDS)
def test_a_function_tool_is_called_with_the_parsed_arguments(daemon: Daemon, kind: str) -> None:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    agent = Agent(
        name="a",
        model=model(daemon, kind, "qwen"),
        tools=[get_weather],
        model_settings=ModelSettings(max_tokens=80, temperature=0, tool_choice="required"),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's
    )
    result = asyncio.run(Runner.run(agent, WEATHER_ASK))
    assert calls == ["Paris"]
    assert result.final_output == "sunny, 21 C in Paris"


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_deltas_make_the_final_output(daemon: Daemon, kind: str) -> None:
    agent = Agent(name="a", model=model(daemon, kind, "qwen"), model_settings=GREEDY)

    async def stream() -> tuple[list[str], object]:
        run = Runner.run_streamed(agent, "Say hello.")
        deltas = [
            ev.data.delta
            async for ev in run.stream_events()
            if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta"
        ]
        return deltas, run.final_output

    deltas, final = asyncio.run(stream())
    assert len(deltas) > 1
    assert "".join(deltas) == final
