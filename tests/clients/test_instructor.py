"""instructor over the official OpenAI client against a live daemon: each of its modes
(forced tool call, json_schema response format, JSON mode, fenced JSON) hands back the
typed object, and its partial stream builds it up."""

from __future__ import annotations

import instructor
import openai
import pytest

from tests.clients.models import WHERE, City, paris
from tests.daemon import Daemon

ASK = [{"role": "user", "content": WHERE}]


def client(daemon: Daemon, mode: instructor.Mode) -> instructor.Instructor:
    sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    return instructor.from_openai(sdk, mode=mode)


@pytest.mark.parametrize(
    "mode",
    [
        instructor.Mode.TOOLS,
        instructor.Mode.JSON_SCHEMA,
        instructor.Mode.JSON,
        instructor.Mode.MD_JSON,
    ],
)
def test_each_mode_returns_the_typed_object(daemon: Daemon, mode: instructor.Mode) -> None:
    city, completion = client(daemon, mode).chat.completions.create_with_completion(
        model="qwen",
        response_model=City,
        messages=ASK,
        temperature=0,
        max_tokens=80,
        max_retries=0,  # the first answer must parse: no re-asking
    )
    paris(city)
    assert completion.usage.prompt_tokens > 0
    if mode is instructor.Mode.TOOLS:
        (call,) = completion.choices[0].message.tool_calls
        assert call.function.name == "City"


def test_a_partial_stream_ends_in_the_whole_object(daemon: Daemon) -> None:
    partials = list(
        client(daemon, instructor.Mode.JSON_SCHEMA).chat.completions.create_partial(
            model="qwen",
            response_model=City,
            messages=ASK,
            temperature=0,
            max_tokens=80,
        )
    )
    assert len(partials) > 1  # built up as the JSON streams in
    paris(City.model_validate(partials[-1].model_dump()))


def test_a_partial_stream_in_tools_mode_builds_the_object_up(daemon: Daemon) -> None:
    """TOOLS mode reads the forced call's arguments as they stream: several partial
    objects, the last the whole one."""
    partials = list(
        client(daemon, instructor.Mode.TOOLS).chat.completions.create_partial(
            model="qwen",
            response_model=City,
            messages=ASK,
            temperature=0,
            max_tokens=80,
        )
    )
    assert len(partials) > 2
    paris(City.model_validate(partials[-1].model_dump()))
