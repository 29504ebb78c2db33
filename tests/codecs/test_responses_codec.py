"""The Responses codec without a model: golden requests and responses."""

from __future__ import annotations

import pytest

from barrel.errors import InvalidRequest
from barrel.http.codecs import Begin
from barrel.http.codecs import openai_responses as codec
from barrel.pipeline.events import (
    CallResult,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    ServerTool,
    ServerTools,
    TextDelta,
    ToolCallEvent,
)
from barrel.pipeline.request import Format, Message, TextPart, ToolCall, text
from tests.codecs.golden import body, finished, stamp, wire

EARLIER = (text("user", "Hi"), text("assistant", "Hello!"))


def history(response_id: str) -> tuple[Message, ...] | None:
    return EARLIER if response_id == "resp_1" else None


def test_items_continue_a_stored_conversation() -> None:
    req, _ = codec.decode(
        body(
            model="qwen",
            previous_response_id="resp_1",
            instructions="Be brief.",
            input=[
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "22 degrees"},
                {"type": "reasoning", "summary": []},
                {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
            ],
            text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
            max_output_tokens=40,
            reasoning={"effort": "high"},
        ),
        history,
    )  # fmt: skip
    assert req.messages == (
        text("system", "Be brief."),
        *EARLIER,
        Message(
            role="assistant", tool_calls=(ToolCall("call_1", "get_weather", {"city": "Paris"}),)
        ),
        Message(role="tool", parts=(TextPart("22 degrees"),), tool_call_id="call_1"),
        text("user", "And tomorrow?"),
    )
    assert req.format == Format("json_schema", {"type": "object"})
    assert (req.max_tokens, req.reasoning_effort) == (40, "high")


def test_an_unknown_previous_response_is_a_400_with_its_code() -> None:
    with pytest.raises(codec.PreviousResponseNotFound) as gone:
        codec.decode(body(model="m", input="x", previous_response_id="resp_2"), history)
    assert (gone.value.code, gone.value.param) == ("previous_response_not_found", "previous_response_id")  # fmt: skip
    with pytest.raises(InvalidRequest) as bad:
        codec.decode(body(model="m", input=[{"type": "computer_call"}]), history)
    assert bad.value.param == "input[0]"


def test_output_items_and_named_events_with_sequence_numbers() -> None:
    req, parsed = codec.decode(body(model="qwen", input="Weather?", stream=True), history)
    enc = codec.ResponsesEncoder(req, parsed, stamp())
    frames = [
        *enc.begin(Begin(39)),
        *enc.feed(0, ReasoningDelta("Look it up.")),
        *enc.feed(0, TextDelta("One moment.")),
        *enc.feed(0, ToolCallEvent("abc", "get_weather", '{"city":"Paris"}')),
        *enc.feed(0, finished("length")),
        *enc.end(),
    ]
    events = wire(frames)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    full = enc.full()
    assert full["status"] == "incomplete"
    assert full["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in full["output"]] == ["reasoning", "message", "function_call"]
    assert full["output"][2]["call_id"] == "call_abc"
    assert full["usage"]["input_tokens_details"]["cached_tokens"] == 30
    assert enc.as_messages() == (
        Message(
            role="assistant",
            parts=(TextPart("One moment."),),
            tool_calls=(ToolCall("call_abc", "get_weather", {"city": "Paris"}),),
        ),
    )
    error = wire(enc.error(InvalidRequest("bad", param="x")))[0]
    assert error[0] == "error"
    assert {k: error[1][k] for k in ("code", "message", "param")} == {"code": "invalid_request", "message": "bad", "param": "x"}  # fmt: skip


def test_mcp_tools_name_servers_and_mcp_items_round_trip_as_calls_and_results() -> None:
    req, b = codec.decode(
        body(
            model="qwen",
            input=[
                {"role": "user", "content": "Weather?"},
                {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "w", "tools": []},
                {"type": "mcp_call", "id": "mcp_1", "server_label": "w", "name": "get_weather", "arguments": '{"city": "Oslo"}', "output": "Sunny"},
                {"type": "mcp_call", "id": "mcp_2", "server_label": "w", "name": "get_wind", "arguments": "{}", "error": {"type": "mcp_tool_execution_error", "content": []}},
                {"role": "assistant", "content": "Sunny in Oslo."},
            ],
            tools=[
                {"type": "mcp", "server_label": "w", "allowed_tools": ["get_weather"], "require_approval": "never"},
                {"type": "mcp", "server_label": "f", "server_url": "http://127.0.0.1:9/mcp"},
            ],
        ),
        history,
    )  # fmt: skip
    assert [(u.name, u.url, u.tools) for u in req.servers] == [
        ("w", "", ("get_weather",)),
        ("f", "http://127.0.0.1:9/mcp", None),
    ]
    calls = (ToolCall("mcp_1", "get_weather", {"city": "Oslo"}), ToolCall("mcp_2", "get_wind", {}))
    assert req.messages[1:] == (
        Message(role="assistant", tool_calls=calls),
        Message(role="tool", parts=(TextPart("Sunny"),), tool_call_id="mcp_1", name="get_weather"),
        Message(
            role="tool",
            parts=(TextPart('{"type": "mcp_tool_execution_error", "content": []}'),),
            tool_call_id="mcp_2",
            name="get_wind",
        ),
        text("assistant", "Sunny in Oslo."),
    )
    # what the encoder writes, stored, comes back as the same turn
    enc = codec.ResponsesEncoder(req, b, stamp())
    enc.begin(Begin(5, 0.0, 0.0))
    frames = [
        *enc.feed(
            0,
            ServerTools("w", (ServerTool("w", "get_weather", "The weather.", {"type": "object"}),)),
        ),
        *enc.feed(0, TextDelta("Let me see. ")),
        *enc.feed(0, ServerCall("c1", "w", "get_weather", '{"city": "Oslo"}')),
        *enc.feed(0, ServerResult("c1", "w", "get_weather", CallResult("Sunny"))),
        *enc.feed(0, TextDelta("Sunny in Oslo.")),
        *enc.feed(0, finished()),
    ]
    kinds = [kind for kind, _ in wire(frames)]
    assert kinds.count("response.mcp_list_tools.completed") == 1
    assert kinds.index("response.mcp_call.in_progress") < kinds.index("response.mcp_call.completed")
    assert [i["type"] for i in enc.full()["output"]] == [
        "mcp_list_tools",
        "message",
        "mcp_call",
        "message",
    ]
    call = enc.full()["output"][2]
    assert (call["status"], call["output"], call["error"]) == ("completed", "Sunny", None)
    oslo = ToolCall(call["id"], "get_weather", {"city": "Oslo"})
    assert enc.as_messages() == (
        Message(role="assistant", parts=(TextPart("Let me see. "),), tool_calls=(oslo,)),
        Message(
            role="tool", parts=(TextPart("Sunny"),), tool_call_id=call["id"], name="get_weather"
        ),
        text("assistant", "Sunny in Oslo."),
    )


@pytest.mark.parametrize(
    ("tool", "words"),
    [
        ({"type": "mcp", "server_label": "w", "require_approval": "always"}, "require_approval"),
        ({"type": "mcp", "server_label": ""}, "server_label"),
        ({"type": "mcp", "server_label": "w", "allowed_tools": "get_weather"}, "allowed_tools"),
        ({"type": "mcp", "server_label": "w", "connector_id": "connector_gmail"}, "connector"),
    ],
)
def test_mcp_tools_the_server_cannot_honour_are_400s(tool: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        codec.decode(body(model="m", input="x", tools=[tool]), history)
