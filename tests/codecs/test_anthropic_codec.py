"""The Messages codec without a model: golden requests and responses."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from barrel.errors import InvalidRequest, Unavailable
from barrel.http.codecs import Begin
from barrel.http.codecs import anthropic as codec
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
    ImagePart,
    Message,
    Options,
    TextPart,
    ToolCall,
    ToolChoice,
    text,
)
from tests.codecs.golden import body, finished, stamp, wire

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_blocks_decode_into_neutral_messages() -> None:
    png = base64.b64encode(b"\x89PNG").decode()
    req, _ = codec.decode(
        body(
            model="qwen",
            max_tokens=64,
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 degrees"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                        {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
            tools=[WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            thinking={"type": "enabled", "budget_tokens": 32},
            stop_sequences=["END"],
            temperature=0.3,
            top_k=5,
            metadata={"user_id": "user-7"},
        ),
        counting=False,
    )  # fmt: skip
    assert req.dialect is Dialect.ANTHROPIC
    assert req.messages == (
        text("system", "Be brief."),
        text("user", "Weather in Paris?"),
        Message(
            role="assistant",
            tool_calls=(ToolCall("toolu_1", "get_weather", {"city": "Paris"}),),
            reasoning="Use the tool.",
        ),
        Message(role="tool", parts=(TextPart("22 degrees"),), tool_call_id="toolu_1"),
        Message(
            role="user",
            parts=(ImagePart(data=b"\x89PNG", media_type="image/png"), TextPart("Thanks")),
        ),
    )
    assert req.pin_messages == 5  # the cache breakpoint is in the last message
    assert req.tool_choice == ToolChoice("required")
    assert req.parallel_tool_calls is False
    assert (req.thinking, req.reasoning_budget, req.max_tokens) == (True, 32, 64)
    assert req.stop == ("END",)
    assert req.options == Options(temperature=0.3, top_k=5)
    assert req.user == "user-7"


def test_bad_requests_are_400s() -> None:
    hi = [{"role": "user", "content": "hi"}]
    for fields, message in [
        ({"messages": hi, "max_tokens": 5}, "model"),
        ({"model": "m", "messages": hi}, "max_tokens"),
        ({"model": "m", "messages": [], "max_tokens": 5}, "at least one message"),
        ({"model": "m", "messages": hi, "max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 9}}, "greater than"),
        ({"model": "m", "messages": hi, "max_tokens": 5, "tool_choice": {"type": "maybe"}}, "tool_choice"),
        ({"model": "m", "messages": hi, "max_tokens": 5, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "custom tools"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}], "max_tokens": 5}, "video"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequest, match=message):
            codec.decode(body(**fields), counting=False)
    req, _ = codec.decode(body(model="m", messages=hi), counting=True)  # counting: no max
    assert req.max_tokens is None


def _encoder() -> codec.MessagesEncoder:
    req, _ = codec.decode(body(model="qwen", max_tokens=64, messages=[{"role": "user", "content": "hi"}]), counting=False)  # fmt: skip
    return codec.MessagesEncoder(req, stamp())


def test_a_stream_opens_and_closes_blocks_as_the_kind_changes() -> None:
    enc = _encoder()
    sig = codec.signature("Hm.")
    frames = [
        *enc.waiting(1, None),
        *enc.begin(Begin(39)),
        *enc.feed(0, ReasoningDelta("Hm.")),
        *enc.feed(0, TextDelta("Sure.")),
        *enc.feed(0, ToolCallEvent("abc", "get_weather", '{"city":"Paris"}')),
        *enc.feed(0, finished("tool_calls")),
        *enc.end(),
    ]
    start_usage = {"input_tokens": 39, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}  # fmt: skip
    message = {"id": "msg_X", "type": "message", "role": "assistant", "model": "qwen", "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}  # fmt: skip
    # the three input counts add up to the prompt (39), as Anthropic's do
    usage = {"input_tokens": 9, "output_tokens": 7, "cache_read_input_tokens": 30, "cache_creation_input_tokens": 0}  # fmt: skip

    def delta(i: int, d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})

    def start(i: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_start", {"type": "content_block_start", "index": i, "content_block": block})  # fmt: skip

    def stop(i: int) -> tuple[str, dict[str, Any]]:
        return ("content_block_stop", {"type": "content_block_stop", "index": i})

    ping = ("ping", {"type": "ping"})
    assert wire(frames) == [
        ping,
        ("message_start", {"type": "message_start", "message": message}),
        start(0, {"type": "thinking", "thinking": "", "signature": ""}),
        ping,
        delta(0, {"type": "thinking_delta", "thinking": "Hm."}),
        delta(0, {"type": "signature_delta", "signature": sig}),
        stop(0),
        start(1, {"type": "text", "text": ""}),
        delta(1, {"type": "text_delta", "text": "Sure."}),
        stop(1),
        start(2, {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}),
        delta(2, {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}),
        stop(2),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": usage,
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    full = enc.full()
    assert full["content"] == [
        {"type": "thinking", "thinking": "Hm.", "signature": sig},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (full["stop_reason"], full["usage"]) == ("tool_use", usage)


def test_stop_reasons_and_the_error_event() -> None:
    for fin, reason, sequence in [
        (finished("stop"), "end_turn", None),
        (finished("length"), "max_tokens", None),
        (finished("stop", stop_sequence="END"), "stop_sequence", "END"),
    ]:
        enc = _encoder()
        enc.feed(0, TextDelta("x"))
        enc.feed(0, fin)
        assert (enc.full()["stop_reason"], enc.full()["stop_sequence"]) == (reason, sequence)
    enc = _encoder()
    assert wire(enc.error(Unavailable("the engine crashed"))) == [
        (
            "error",
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "the engine crashed"},
            },
        ),
    ]


def test_the_mcp_connector_names_servers_and_its_blocks_round_trip() -> None:
    req, _ = codec.decode(
        body(
            model="m",
            max_tokens=50,
            mcp_servers=[
                {"type": "url", "name": "w", "url": "http://127.0.0.1:9/mcp", "tool_configuration": {"allowed_tools": ["get_weather"]}},
                {"type": "url", "name": "off", "url": "", "tool_configuration": {"enabled": False}},
            ],
            tools=[{"type": "mcp_toolset", "mcp_server_name": "w"}],
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "get_weather", "server_name": "w", "input": {"city": "Oslo"}},
                        {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False, "content": [{"type": "text", "text": "Sunny"}]},
                        {"type": "text", "text": "Sunny in Oslo."},
                    ],
                },
                {"role": "user", "content": "Thanks"},
            ],
        ),
        counting=False,
    )  # fmt: skip
    assert [(u.name, u.url, u.tools) for u in req.servers] == [
        ("w", "http://127.0.0.1:9/mcp", ("get_weather",))
    ]
    assert req.tools == ()
    oslo = ToolCall("mcptoolu_1", "get_weather", {"city": "Oslo"})
    assert req.messages == (
        text("user", "Weather?"),
        Message(role="assistant", parts=(TextPart("Checking."),), tool_calls=(oslo,)),
        Message(role="tool", parts=(TextPart("Sunny"),), tool_call_id="mcptoolu_1", name="get_weather"),
        text("assistant", "Sunny in Oslo."),
        text("user", "Thanks"),
    )  # fmt: skip
    enc = codec.MessagesEncoder(req, stamp())
    frames = [
        *enc.feed(0, ServerCall("c1", "w", "get_weather", '{"city": "Oslo"}')),
        *enc.feed(0, ServerResult("c1", "w", "get_weather", CallResult("Sunny"))),
        *enc.feed(0, TextDelta("Sunny.")),
        *enc.feed(0, finished()),
    ]
    starts = [
        p["content_block"]["type"] for kind, p in wire(frames) if kind == "content_block_start"
    ]
    assert starts == ["mcp_tool_use", "mcp_tool_result", "text"]
    use, result, _ = enc.full()["content"]
    assert use == {"type": "mcp_tool_use", "id": "mcptoolu_c1", "name": "get_weather", "server_name": "w", "input": {"city": "Oslo"}}  # fmt: skip
    assert result == {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_c1", "is_error": False, "content": [{"type": "text", "text": "Sunny"}]}  # fmt: skip


def test_mcp_servers_of_the_wrong_shape_are_400s() -> None:
    for servers in (
        "w",
        [{"type": "stdio", "name": "w"}],
        [{"type": "url"}],
        [{"name": "w"}, {"name": "w"}],
        # a disabled server is checked too, and counting tokens checks like messages
        [{"type": "url", "tool_configuration": {"enabled": False}}],
        [{"name": "w", "tool_configuration": {"enabled": False, "allowed_tools": [""]}}],
    ):
        for counting in (False, True):
            with pytest.raises(InvalidRequest, match="mcp_servers"):
                codec.decode(body(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}], mcp_servers=servers), counting=counting)  # fmt: skip
    req, _ = codec.decode(body(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}], mcp_servers=[{"name": "w", "tool_configuration": {"enabled": False}}]), counting=True)  # fmt: skip
    assert req.servers == ()  # disabled: not used
