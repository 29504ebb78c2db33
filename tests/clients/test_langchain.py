"""LangChain's three chat integrations (langchain-openai, -anthropic, -ollama) against a
live daemon: what each hands its user — messages, usage metadata, parsed tool calls,
structured output through `with_structured_output`, embeddings, and its own
context-overflow exception class."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.exceptions import ContextOverflowError
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_ollama import ChatOllama, OllamaEmbeddings
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from tests.clients.conftest import ASK, LONG, counted
from tests.clients.models import WEATHER_ASK, WHERE, City, paris
from tests.daemon import Daemon

PROVIDERS = ["openai", "anthropic", "ollama"]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city"""
    return "sunny"


def chat(daemon: Daemon, provider: str, model: str, tokens: int) -> BaseChatModel:
    if provider == "openai":
        return ChatOpenAI(
            base_url=daemon.url + "/v1",
            api_key="unused",
            model=model,
            max_tokens=tokens,
            temperature=0,
            max_retries=0,
            stream_usage=True,
        )
    if provider == "anthropic":
        return ChatAnthropic(
            base_url=daemon.url,
            api_key="unused",
            model=model,
            max_tokens=tokens,
            temperature=0,
            max_retries=0,
        )
    return ChatOllama(base_url=daemon.url, model=model, num_predict=tokens, temperature=0)


def _joined(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    return whole


@pytest.mark.parametrize("provider", PROVIDERS)
def test_invoke_and_stream_agree_and_count_the_true_prompt(daemon: Daemon, provider: str) -> None:
    model = chat(daemon, provider, "tiny", 5)
    size = counted(daemon, "tiny", ASK)
    answer = model.invoke(ASK)
    assert isinstance(answer, AIMessage)
    assert answer.content
    assert answer.usage_metadata is not None
    # the second call reads the KV cache: the input total is still the whole prompt
    assert answer.usage_metadata["input_tokens"] == size
    assert answer.usage_metadata["output_tokens"] == 5
    chunks = [c for c in model.stream(ASK) if isinstance(c, AIMessageChunk)]
    assert len(chunks) > 1
    whole = _joined(chunks)
    assert whole.content == answer.content  # greedy: the same five tokens
    assert whole.usage_metadata is not None
    assert whole.usage_metadata["input_tokens"] == size


@pytest.mark.parametrize("provider", PROVIDERS)
def test_with_structured_output_parses_the_model(daemon: Daemon, provider: str) -> None:
    structured = chat(daemon, provider, "qwen", 80).with_structured_output(City)
    city = structured.invoke(WHERE)
    assert isinstance(city, City)
    paris(city)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_bind_tools_gives_a_parsed_tool_call(daemon: Daemon, provider: str) -> None:
    choice: Any = None if provider == "ollama" else "get_weather"  # Ollama has no choice
    model = chat(daemon, provider, "qwen", 60).bind_tools([get_weather], tool_choice=choice)
    answer = model.invoke(WEATHER_ASK)
    assert isinstance(answer, AIMessage)
    (call,) = answer.tool_calls
    assert call["name"] == "get_weather"
    assert call["args"] == {"city": "Paris"}
    assert call["id"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_an_over_long_prompt_is_langchains_context_overflow(daemon: Daemon, provider: str) -> None:
    with pytest.raises(ContextOverflowError):
        chat(daemon, provider, "tiny", 5).invoke(LONG)


def test_ollama_truncates_an_over_long_prompt_as_ollama_does(daemon: Daemon) -> None:
    answer = chat(daemon, "ollama", "tiny", 5).invoke(LONG)
    assert isinstance(answer, AIMessage)
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["output_tokens"] == 5
    assert answer.usage_metadata["input_tokens"] < 2048  # the context minus the answer's room


def test_embeddings_through_both_integrations_agree(daemon: Daemon) -> None:
    openai_side = OpenAIEmbeddings(
        base_url=daemon.url + "/v1",
        api_key="unused",
        model="qwen",
        check_embedding_ctx_length=False,  # send text, not tiktoken ids
    ).embed_documents(["hello", "world"])
    ollama_side = OllamaEmbeddings(base_url=daemon.url, model="qwen").embed_documents(
        ["hello", "world"]
    )
    assert [len(v) for v in openai_side] == [896, 896]
    assert [len(v) for v in ollama_side] == [896, 896]
    assert openai_side[0] != openai_side[1]
    assert openai_side[0] == pytest.approx(ollama_side[0], abs=1e-4)
