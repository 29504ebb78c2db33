"""litellm, a client people put in front of Barrel, through its openai/, anthropic/ and
ollama_chat/ providers: what it hands its user (answers, tool calls, usage, its
exception classes)."""

from __future__ import annotations

import json

import litellm
import pytest

from tests.clients.conftest import ASK, LONG, counted
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
