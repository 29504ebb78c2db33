"""litellm, a client people put in front of Barrel, through its openai/, anthropic/ and
ollama_chat/ providers: what it hands its user (answers, tool calls, usage, its
exception classes)."""

from __future__ import annotations

import json

import litellm
import pytest

from tests.clients.conftest import ASK, LONG, counted
from tests.clients.models import WHERE, City, paris
from tests.daemon import Daemon
from tests.tools import WEATHER


def _kw(daemon: Daemon, provider: str) -> dict[str, object]:
    base = daemon.url + "/v1" if provider == "openai" else daemon.url
    return {"model": f"{provider}/tiny", "api_base": base, "api_key": "unused", "num_retries": 0}


@pytest.mark.parametrize("provider", ["openai", "anthropic", "ollama_chat"])
def test_chat_and_stream(daemon: Daemon, provider: str) -> None:
    r = litellm.completion(messages=ASK, max_tokens=5, temperature=0, **_kw(daemon, provider))
    assert r.choices[0].message.content
    assert r.usage.completion_tokens > 0
    chunks = list(
        litellm.completion(
            messages=ASK, max_tokens=5, temperature=0, stream=True, **_kw(daemon, provider)
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_an_over_long_prompt_is_a_context_window_error(daemon: Daemon, provider: str) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            messages=[{"role": "user", "content": LONG}], max_tokens=5, **_kw(daemon, provider)
        )


def test_anthropic_usage_reports_the_true_prompt_size(daemon: Daemon) -> None:
    size = counted(daemon, "tiny", ASK)
    for _ in range(2):  # the second one reads the KV cache: the total stays the prompt
        r = litellm.completion(
            messages=ASK, max_tokens=5, temperature=0, **_kw(daemon, "anthropic")
        )
        assert r.usage.prompt_tokens == size


def test_a_forced_tool_call_is_litellms_tool_call(daemon: Daemon) -> None:
    r = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
        **_kw(daemon, "openai"),
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("provider", ["openai", "ollama"])
def test_model_listing_through_the_provider_endpoint(daemon: Daemon, provider: str) -> None:
    base = daemon.url + "/v1" if provider == "openai" else daemon.url
    listed = litellm.get_valid_models(
        check_provider_endpoint=True, custom_llm_provider=provider, api_key="k", api_base=base
    )
    assert {"tiny", "qwen"} <= {name.split("/", 1)[-1] for name in listed}, listed


def test_structured_output_with_a_pydantic_model(daemon: Daemon) -> None:
    kw = {**_kw(daemon, "openai"), "model": "openai/qwen"}
    r = litellm.completion(
        messages=[{"role": "user", "content": WHERE}],
        response_format=City,
        max_tokens=80,
        temperature=0,
        **kw,
    )
    paris(City.model_validate_json(r.choices[0].message.content))


@pytest.mark.parametrize("provider", ["openai", "ollama"])
def test_embeddings(daemon: Daemon, provider: str) -> None:
    base = daemon.url + "/v1" if provider == "openai" else daemon.url
    r = litellm.embedding(
        model=f"{provider}/qwen", input=["hello", "world"], api_base=base, api_key="k"
    )
    vectors = [d["embedding"] for d in r.data]
    assert [len(v) for v in vectors] == [896, 896]
    assert vectors[0] != vectors[1]
    assert r.usage.prompt_tokens > 0
