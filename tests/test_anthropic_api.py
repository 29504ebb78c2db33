"""Anthropic's Messages API through the official anthropic SDK against `barrel serve`,
on the real Qwen model and the tiny one."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
import pytest

from tests.daemon import Daemon, serve_models
from tests.tools import CITY, DESCRIPTION, SHORT_CITY

pytestmark = pytest.mark.real_model

WEATHER: Any = {"name": "get_weather", "description": DESCRIPTION, "input_schema": CITY}
SHORT: Any = {**WEATHER, "input_schema": SHORT_CITY}
# greedy, Qwen writes all 600 tokens for this: a request that holds its slot for long
COUNT: Any = [
    {"role": "user", "content": "Write the numbers from 1 to 200 in words, one per line."}
]
GREEDY = {"temperature": 0}  # sampling knobs go in the body: SDK 2.x dropped them
QUESTION: Any = [
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
]


def _daemon(tmp: Path, qwen_path: Path, tiny_path: Path, defaults: str) -> Daemon:
    return serve_models(
        tmp,
        {"qwen": qwen_path, "tiny": tiny_path},
        f'import_dir = "{qwen_path.parent}"\n[models.defaults]\n{defaults}',
    )


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = _daemon(tmp_path_factory.mktemp("anthropic-api"), qwen_path, tiny_path, "num_seq_max = 2")
    yield d
    d.kill()


@pytest.fixture
def client(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", timeout=120, max_retries=0)


def test_message_without_streaming(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model="qwen",
        max_tokens=48,
        extra_body=GREEDY,
        system="You are a geography tutor.",
        messages=QUESTION,
    )
    assert r.type == "message"
    assert r.role == "assistant"
    assert r.model == "qwen"
    assert r.content[0].type == "text"
    assert "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn"
    assert r.usage.input_tokens > 10
    assert 0 < r.usage.output_tokens <= 48
    assert r.id.startswith("msg_")


def test_stream_helper_yields_final_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="qwen", max_tokens=48, extra_body=GREEDY, messages=QUESTION
    ) as stream:
        kinds = [event.type for event in stream]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_start" in kinds
    assert "content_block_stop" in kinds
    assert kinds[-2] == "message_delta"
    assert text == ""  # consumed above: the iterator is single-use
    assert "Paris" in final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_raw_sse_order_has_ping_and_no_done(daemon: Daemon) -> None:
    body = json.dumps(
        {"model": "qwen", "max_tokens": 3, "stream": True, "messages": QUESTION}
    ).encode()
    req = urllib.request.Request(
        daemon.url + "/v1/messages?beta=true",
        data=body,
        headers={
            "content-type": "application/json",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "prompt-caching-2024-07-31",
        },
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in raw
    delta = json.loads(raw.split("event: message_delta\ndata: ")[1].split("\n")[0])
    assert delta["delta"]["stop_reason"] == "max_tokens"


def test_tool_round_trip_auto_on_qwen(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.messages.create(
        model="qwen", max_tokens=96, extra_body=GREEDY, tools=[WEATHER], messages=ask
    )
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather"
    assert "paris" in str(use.input).lower()
    follow: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees, sunny"}
            ],
        },
    ]
    # Qwen 0.5B at greedy, without a repeat penalty (Anthropic's default), answers a
    # tool's result by calling the tool again; llama-server's repeat_penalty lets it answer.
    unstuck = {**GREEDY, "repeat_penalty": 1.1}
    final = client.messages.create(
        model="qwen", max_tokens=64, extra_body=unstuck, tools=[WEATHER], messages=follow
    )
    # the tool's result reaches the model; Qwen 0.5B may repeat its call before it
    answer = "".join(b.text for b in final.content if b.type == "text")
    assert "22" in answer, final.content


def test_forced_tool_on_tiny_and_streamed_input_json(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model="tiny",
        max_tokens=200,
        tools=[SHORT],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "weather?"}],
    )
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    assert isinstance(use.input, dict)
    assert isinstance(use.input.get("city"), str)  # the grammar keeps to the schema
    assert r.stop_reason == "tool_use"
    with client.messages.stream(
        model="tiny",
        max_tokens=200,
        tools=[SHORT],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "weather?"}],
    ) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert any(e.delta.type == "input_json_delta" for e in deltas)
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert set(streamed.input) >= {"city"}  # type: ignore[arg-type]


def test_thinking_streams_thinking_deltas(
    client: anthropic.Anthropic, daemon: Daemon, qwen_path: Path, llama_templates: Path
) -> None:
    template = (llama_templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    ollama.Client(host=daemon.url, timeout=300).create(
        model="qwen-think", from_=str(qwen_path), template=template
    )
    with client.messages.stream(
        model="qwen-think",
        max_tokens=64,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 24},
        messages=QUESTION,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thinking = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    ]
    assert thinking, [e.type for e in events]
    assert any(
        e.type == "content_block_delta" and e.delta.type == "signature_delta" for e in events
    )
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking.strip()
    assert any(b.type == "text" and b.text for b in final.content)
    # passed back in history (with its signature), the thinking block is accepted
    again = client.messages.create(
        model="qwen-think",
        max_tokens=16,
        extra_body=GREEDY,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {"role": "user", "content": "And of Italy?"},
        ],
    )
    assert again.content
    assert again.usage.output_tokens > 0


def test_count_tokens_matches_input_tokens(client: anthropic.Anthropic) -> None:
    kwargs: Any = {
        "model": "qwen",
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [WEATHER],
        "messages": QUESTION,
    }
    counted = client.messages.count_tokens(**kwargs)
    r = client.messages.create(max_tokens=8, extra_body=GREEDY, **kwargs)
    u = r.usage
    # as in Anthropic's API, the three input counts add up to the prompt
    total = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    assert counted.input_tokens == total > 50


def test_second_turn_reads_the_cache(client: anthropic.Anthropic) -> None:
    meta: Any = {"user_id": "anthropic-cache-test"}
    first = client.messages.create(
        model="qwen", max_tokens=24, extra_body=GREEDY, metadata=meta, messages=QUESTION
    )
    assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) > 10
    second = client.messages.create(
        model="qwen",
        max_tokens=24,
        extra_body=GREEDY,
        metadata=meta,
        messages=[
            *QUESTION,
            {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
            {"role": "user", "content": "And of Germany?"},
        ],
    )
    assert second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 2
    assert second.usage.input_tokens < second.usage.cache_read_input_tokens


def test_errors_in_anthropic_envelope(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", max_tokens=8, messages=QUESTION)
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    image: Any = [
        {
            "role": "user",
            "content": [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                },
                {"type": "text", "text": "what is this?"},
            ],
        }
    ]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="qwen", max_tokens=8, messages=image)
    assert "text only" in bad.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="qwen", max_tokens=0, messages=QUESTION)
    # bad input is refused before the model is even looked up
    with pytest.raises(anthropic.BadRequestError) as early:
        client.messages.create(
            model="nope",
            max_tokens=8,
            messages=QUESTION,
            thinking={"type": "enabled", "budget_tokens": 16},
            tool_choice={"type": "sometimes"},  # type: ignore[typeddict-item]
        )
    assert "tool_choice" in early.value.message


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic) -> None:
    r = client.messages.create(
        model="qwen",
        max_tokens=64,
        extra_body=GREEDY,
        stop_sequences=["Paris"],
        messages=QUESTION,
    )
    assert r.stop_reason == "stop_sequence"
    assert r.stop_sequence == "Paris"
    assert "Paris" not in r.content[0].text  # type: ignore[union-attr]
    short = client.messages.create(model="qwen", max_tokens=2, messages=QUESTION)
    assert short.stop_reason == "max_tokens"
    assert short.usage.output_tokens == 2


@pytest.fixture(scope="module")
def solo(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = _daemon(
        tmp_path_factory.mktemp("anthropic-solo"),
        qwen_path,
        tiny_path,
        "num_seq_max = 1\nqueue_depth = 0",
    )
    yield d
    d.kill()


def test_full_queue_529_then_sdk_retry_succeeds(solo: Daemon) -> None:
    busy = anthropic.Anthropic(base_url=solo.url, api_key="k", timeout=120, max_retries=0)
    with busy.messages.stream(
        model="qwen", max_tokens=600, extra_body=GREEDY, messages=COUNT
    ) as long:
        next(iter(long))  # message_start: the only slot is taken
        raw = httpx.post(
            solo.url + "/v1/messages",
            json={"model": "qwen", "max_tokens": 4, "messages": QUESTION},
            timeout=30,
        )
        assert raw.status_code == 529
        assert raw.json()["error"]["type"] == "overloaded_error"
        assert int(raw.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.APIStatusError) as over:
            busy.messages.create(model="qwen", max_tokens=4, messages=QUESTION)
        assert over.value.status_code == 529
    # the SDK's own retry (after retry-after) gets through once the slot frees up
    statuses: list[int] = []
    hooks = {"response": [lambda r: statuses.append(r.status_code)]}
    patient = anthropic.Anthropic(
        base_url=solo.url,
        api_key="k",
        timeout=120,
        max_retries=4,
        http_client=httpx2.Client(event_hooks=hooks),
    )
    result: list[Any] = []
    # the first stream's slot frees once the server sees the client gone: retry until then
    waiting = busy.with_options(max_retries=8)
    with waiting.messages.stream(
        model="qwen", max_tokens=600, extra_body=GREEDY, messages=COUNT
    ) as long:
        next(iter(long))
        t = threading.Thread(
            target=lambda: result.append(
                patient.messages.create(model="qwen", max_tokens=8, messages=QUESTION)
            )
        )
        t.start()
        deadline = time.monotonic() + 30
        while 529 not in statuses and time.monotonic() < deadline:
            time.sleep(0.05)
    t.join(timeout=120)
    assert statuses[0] == 529
    assert statuses[-1] == 200
    assert result
    assert result[0].usage.output_tokens > 0


@pytest.fixture(scope="module")
def impatient(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = _daemon(
        tmp_path_factory.mktemp("anthropic-impatient"),
        qwen_path,
        tiny_path,
        "num_seq_max = 1\nqueue_depth = 1\nqueue_timeout_s = 1.5",
    )
    yield d
    d.kill()


def test_a_waiting_stream_pings_then_ends_with_an_error_event(impatient: Daemon) -> None:
    busy = anthropic.Anthropic(base_url=impatient.url, api_key="k", timeout=120, max_retries=0)
    with busy.messages.stream(
        model="qwen", max_tokens=600, extra_body=GREEDY, messages=COUNT
    ) as long:
        next(iter(long))  # the only slot is taken; the next request waits in the queue
        with httpx.stream(
            "POST",
            impatient.url + "/v1/messages",
            json={"model": "qwen", "max_tokens": 4, "stream": True, "messages": QUESTION},
            timeout=30,
        ) as waiting:
            assert waiting.status_code == 200
            raw = waiting.read().decode()
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names == ["ping", "error"]  # a ping while queued, then the queue timeout
    error = json.loads(raw.split("event: error\ndata: ")[1].split("\n")[0])
    assert error["type"] == "error"
    assert error["error"]["type"] == "overloaded_error"
    assert "queue" in error["error"]["message"]


def test_the_models_api_answers_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    page = client.models.list(limit=1)
    assert len(page.data) == 1
    first = page.data[0]
    assert first.type == "model"
    assert first.display_name == first.id
    assert first.created_at.year >= 2000
    assert page.has_more is True
    assert page.first_id == page.last_id == first.id
    ids = [m.id for m in client.models.list()]  # the SDK follows the pages
    assert {"qwen", "tiny"} <= set(ids)
    one = client.models.retrieve("tiny")
    assert (one.id, one.type) == ("tiny", "model")


def test_a_prompt_longer_than_the_context_is_anthropics_prompt_too_long(
    client: anthropic.Anthropic,
) -> None:
    long: Any = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model="tiny", max_tokens=4, messages=long)
    assert "prompt is too long: 30" in too_long.value.message
    assert "tokens > 2047 maximum" in too_long.value.message


def test_a_forced_call_cut_by_max_tokens_is_a_tool_use_that_says_max_tokens(
    client: anthropic.Anthropic,
) -> None:
    tool: Any = {"name": "get_weather", "description": DESCRIPTION, "input_schema": CITY}
    r = client.messages.create(
        model="tiny",
        max_tokens=14,
        extra_body=GREEDY,
        tools=[tool],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert r.stop_reason == "max_tokens"
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    assert isinstance(use.input, dict)


@pytest.mark.parametrize("seed", range(1, 7))
def test_the_weather_prompt_is_a_tool_use_at_temperature_0_8(
    client: anthropic.Anthropic, seed: int
) -> None:
    r = client.messages.create(
        model="qwen",
        max_tokens=96,
        extra_body={"temperature": 0.8, "seed": seed},
        tools=[WEATHER],
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
    )
    assert [b.name for b in r.content if b.type == "tool_use"] == ["get_weather"], r.content
