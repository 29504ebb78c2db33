"""pydantic-ai against a live daemon through its OpenAI chat, OpenAI Responses and
Anthropic models: the run's output and usage, typed output, its tool decorator, streamed
text, and its ModelContextWindowExceededError."""

from __future__ import annotations

import asyncio

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelContextWindowExceededError
from pydantic_ai.models import Model
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

from tests.clients.conftest import ASK, LONG, counted
from tests.clients.models import WEATHER_ASK, WHERE, City, paris
from tests.daemon import Daemon

KINDS = ["chat", "responses", "anthropic"]
GREEDY = ModelSettings(max_tokens=80, temperature=0)


def model(daemon: Daemon, kind: str, name: str) -> Model:
    if kind == "anthropic":
        return AnthropicModel(name, provider=AnthropicProvider(base_url=daemon.url, api_key="k"))
    openai = OpenAIProvider(base_url=daemon.url + "/v1", api_key="k")
    if kind == "chat":
        return OpenAIChatModel(name, provider=openai)
    return OpenAIResponsesModel(name, provider=openai)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_reports_its_output_and_the_true_prompt_size(daemon: Daemon, kind: str) -> None:
    # greedy: a sampled answer of the random tiny model can start with its end-of-text
    # token, an empty answer that pydantic-ai asks again for (two requests)
    settings = ModelSettings(max_tokens=5, temperature=0.0)
    agent = Agent(model(daemon, kind, "tiny"), model_settings=settings)
    size = counted(daemon, "tiny", ASK)
    for _ in range(2):  # the second run reads the KV cache: the input is still the prompt
        result = agent.run_sync(ASK[0]["content"])
        assert result.output
        assert result.usage.input_tokens == size
        assert result.usage.output_tokens == 5
        assert result.usage.requests == 1


@pytest.mark.parametrize("kind", KINDS)
def test_typed_output(daemon: Daemon, kind: str) -> None:
    agent = Agent(model(daemon, kind, "qwen"), output_type=City, model_settings=GREEDY)
    city = agent.run_sync(WHERE).output
    assert isinstance(city, City)
    paris(city)


class _Called(Exception):
    pass


@pytest.mark.parametrize("kind", KINDS)
def test_its_tool_decorator_receives_the_parsed_call(daemon: Daemon, kind: str) -> None:
    agent = Agent(model(daemon, kind, "qwen"), model_settings=GREEDY)
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        calls.append(city)
        raise _Called  # one call is the test; the 0.5B model's next turn is not

    with pytest.raises(_Called):
        agent.run_sync(WEATHER_ASK)
    assert calls == ["Paris"]


@pytest.mark.parametrize("kind", KINDS)
def test_streamed_text_is_the_whole_answer(daemon: Daemon, kind: str) -> None:
    greedy = ModelSettings(max_tokens=5, temperature=0)
    agent = Agent(model(daemon, kind, "tiny"), model_settings=greedy)

    async def stream() -> tuple[list[str], int]:
        async with agent.run_stream(ASK[0]["content"]) as run:
            deltas = [d async for d in run.stream_text(delta=True, debounce_by=None)]
            return deltas, run.usage.output_tokens

    deltas, produced = asyncio.run(stream())
    assert len(deltas) > 1
    assert produced == 5
    assert "".join(deltas) == agent.run_sync(ASK[0]["content"]).output  # greedy: the same


@pytest.mark.parametrize("kind", KINDS)
def test_an_over_long_prompt_is_its_context_window_error(daemon: Daemon, kind: str) -> None:
    # greedy: a sampled answer of the random tiny model can start with its end-of-text
    # token, an empty answer that pydantic-ai asks again for (two requests)
    settings = ModelSettings(max_tokens=5, temperature=0.0)
    agent = Agent(model(daemon, kind, "tiny"), model_settings=settings)
    with pytest.raises(ModelContextWindowExceededError):
        agent.run_sync(LONG)
