"""The chat completions codec without a model: golden requests and responses."""

from __future__ import annotations

from typing import Any

import pytest

from barrel.errors import BarrelError, InvalidRequest, Unavailable
from barrel.http.codecs import Begin
from barrel.http.codecs import openai_chat as codec
from barrel.pipeline.events import (
    CallResult,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    TextDelta,
    ToolCallEvent,
)
from barrel.pipeline.request import (
    Dialect,
    Format,
    ImagePart,
    Message,
    Options,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    text,
)
from tests.codecs.golden import body, finished, lp, stamp, wire

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HEAD = {
    "id": "chatcmpl-X",
    "object": "chat.completion.chunk",
    "created": 1_700_000_000,
    "model": "qwen",
    "system_fingerprint": codec.FINGERPRINT,
}


def test_a_conversation_with_tools_decodes_into_the_neutral_request() -> None:
    req, _ = codec.decode(
        body(
            model="qwen",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather in "},
                        {"type": "text", "text": "Paris?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
            ],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0.2,
            stop="END",
            logit_bias={"42": -100},
            logprobs=True,
            top_logprobs=2,
            max_completion_tokens=30,
            n=2,
            stream=True,
            prompt_cache_key="conv-1",
            reasoning_effort="low",
        ),
        None,
    )
    assert req.dialect is Dialect.OPENAI
    assert not req.truncate  # a prompt longer than the context is a 400
    assert req.messages == (
        text("system", "Be brief."),
        Message(role="user", parts=(TextPart("Weather in "), TextPart("Paris?"))),
        Message(
            role="assistant", tool_calls=(ToolCall("call_1", "get_weather", {"city": "Paris"}),)
        ),
        Message(role="tool", parts=(TextPart("22 degrees"),), tool_call_id="call_1"),
    )
    assert req.tools == (
        Tool("get_weather", "Weather in a city", WEATHER["function"]["parameters"]),  # type: ignore[index]
    )
    assert req.tool_choice == ToolChoice("function", "get_weather")
    assert req.options == Options(temperature=0.2, stop=("END",))
    assert req.logit_bias == {42: -100.0}
    assert (req.logprobs, req.max_tokens, req.n, req.stream) == (2, 30, 2, True)
    assert (req.conversation, req.reasoning_effort) == ("conv-1", "low")
    assert req.format == Format()


def test_images_become_image_parts_and_bad_input_is_a_400_naming_the_field() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    req, _ = codec.decode(body(model="m", messages=[{"role": "user", "content": [image]}]))
    assert req.messages[0].parts == (ImagePart(url="data:image/png;base64,AA"),)
    hi = [{"role": "user", "content": "x"}]
    choice = {"type": "function", "function": {}}  # names no function
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"messages": hi}, "model"),
        ({"model": "m", "messages": hi, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
        ),
        ({"model": "m", "messages": hi, "n": 9}, "n"),
        ({"model": "m", "messages": hi, "logit_bias": {"²": 1}}, "logit_bias"),
        ({"model": "m", "messages": hi, "tools": [WEATHER], "tool_choice": choice}, "tool_choice"),
        ({"model": "m", "messages": hi, "response_format": {"type": "yaml"}}, "response_format"),
        ({"model": "m", "messages": hi, "max_tokens": "many"}, "max_tokens"),
    ]
    for fields, param in cases:
        with pytest.raises(InvalidRequest) as bad:
            codec.decode(body(**fields))
        assert bad.value.param == param, fields
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        codec.decode(b"{nope")


def _encoder(**fields: Any) -> codec.ChatEncoder:
    req, parsed = codec.decode(
        body(model="qwen", messages=[{"role": "user", "content": "hi"}], **fields)
    )
    return codec.encoder(req, parsed, stamp())


def test_a_stream_with_reasoning_a_tool_call_and_usage() -> None:
    enc = _encoder(stream=True, stream_options={"include_usage": True})
    frames = [
        *enc.waiting(1, None),
        *enc.waiting(None, 2.4),
        *enc.begin(Begin(39)),
        *enc.feed(0, ReasoningDelta("Paris.")),
        *enc.feed(0, TextDelta("Let me look.")),
        *enc.feed(0, ToolCallEvent("abc", "get_weather", '{"city":"Paris"}')),
        *enc.feed(0, finished("tool_calls")),
        *enc.end(),
    ]

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {**HEAD, "choices": [choice], "usage": None}

    fn = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    call = {"index": 0, "id": "call_abc", "type": "function", "function": fn}
    usage = {
        "prompt_tokens": 39,
        "completion_tokens": 7,
        "total_tokens": 46,
        "prompt_tokens_details": {"cached_tokens": 30},
    }
    assert wire(frames) == [
        ": queued, position 1",
        ": loading the model, 2s",
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "Paris."}),
        chunk({"content": "Let me look."}),
        chunk({"tool_calls": [call]}),
        chunk({}, "tool_calls"),
        {**HEAD, "choices": [], "usage": usage},
        "[DONE]",
    ]
    full = enc.full()
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["content"] == "Let me look."
    assert message["reasoning_content"] == "Paris."
    assert message["tool_calls"] == [{k: v for k, v in call.items() if k != "index"}]
    assert full["usage"] == usage


def test_two_choices_and_logprobs_fold_into_one_response() -> None:
    enc = _encoder(n=2, logprobs=True, top_logprobs=0)
    enc.begin(Begin(39))
    enc.feed(1, TextDelta("B", (lp("B", -0.5),)))
    enc.feed(0, TextDelta("A", (lp("A", -0.1),)))
    enc.feed(0, finished("stop"))
    enc.feed(1, finished("length"))
    assert [f for f in wire(enc.end())] == ["[DONE]"]
    full = enc.full()
    assert [c["message"]["content"] for c in full["choices"]] == ["A", "B"]
    assert [c["finish_reason"] for c in full["choices"]] == ["stop", "length"]
    entry = full["choices"][1]["logprobs"]["content"][0]
    assert entry == {"token": "B", "logprob": -0.5, "bytes": [66], "top_logprobs": []}
    assert full["usage"]["completion_tokens"] == 14  # both choices; the prompt once
    assert full["usage"]["prompt_tokens"] == 39


def test_a_failure_mid_stream_is_an_error_frame_without_done() -> None:
    enc = _encoder(stream=True)
    frames = [*enc.feed(0, TextDelta("Half")), *enc.error(Unavailable("the engine crashed"))]
    assert wire(frames)[-1] == {
        "error": {
            "message": "the engine crashed",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }
    }
    assert "[DONE]" not in wire(frames)
    enc = _encoder()
    with pytest.raises(BarrelError, match="without a result"):
        enc.end()  # the events stopped before Finished


def test_integral_numbers_and_numeric_strings_are_read_and_bad_ones_stay_400s() -> None:
    """JSON Schema counts 5.0 as an integer (and openapi.yaml says integer): the decoder
    reads it as one, and numbers sent as strings as numbers; anything else is still a
    400, and values out of range are checked after the conversion."""
    req, parsed = codec.decode(
        body(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5.0,
            n="2",
            temperature="0.5",
            stream="false",
        )
    )
    assert (req.max_tokens, req.n, req.options.temperature, req.stream) == (5, 2, 0.5, False)
    assert parsed.max_tokens == 5
    for fields in (
        {"max_tokens": 5.5},
        {"max_tokens": "many"},
        {"temperature": "nan"},
        {"temperature": "1e400"},
        {"n": "99"},
        {"logit_bias": {"1": "nan"}},
    ):
        with pytest.raises(InvalidRequest):
            codec.decode(body(model="m", messages=[{"role": "user", "content": "hi"}], **fields))


def test_barrel_s_mcp_servers_field_and_the_server_calls_it_returns() -> None:
    req, b = codec.decode(
        body(
            model="m",
            messages=[{"role": "user", "content": "Weather?"}],
            mcp_servers=["w", {"name": "f", "allowed_tools": ["get_population"]}],
            stream=True,
        )
    )
    assert [(u.name, u.url, u.tools) for u in req.servers] == [
        ("w", "", None),
        ("f", "", ("get_population",)),
    ]
    enc = codec.encoder(req, b, stamp())
    frames = [
        *enc.feed(0, ServerCall("c1", "w", "get_weather", '{"city": "Oslo"}')),
        *enc.feed(0, ServerResult("c1", "w", "get_weather", CallResult("Sunny"))),
        *enc.feed(0, TextDelta("Sunny.")),
        *enc.feed(0, finished()),
    ]
    record = {
        "id": "c1",
        "server": "w",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
        "output": "Sunny",
        "is_error": False,
    }
    deltas = [f["choices"][0]["delta"] for f in wire(frames) if isinstance(f, dict)]
    assert {"server_tool_calls": [record]} in deltas
    assert enc.full()["choices"][0]["message"]["server_tool_calls"] == [record]
    for bad in (
        "w",
        [3],
        [{"allowed_tools": []}],
        ["w", "w"],
        [{"name": "w", "allowed_tools": "x"}],
    ):
        with pytest.raises(InvalidRequest, match="mcp_servers"):
            codec.decode(
                body(model="m", messages=[{"role": "user", "content": "x"}], mcp_servers=bad)
            )
