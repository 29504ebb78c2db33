"""The Ollama codec without a model: golden requests and responses."""

from __future__ import annotations

import base64

import pytest

from barrel.errors import InvalidRequest, Unavailable
from barrel.http.codecs import Begin
from barrel.http.codecs import ollama as codec
from barrel.pipeline.events import (
    CallResult,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    TextDelta,
    ToolCallEvent,
)
from barrel.pipeline.request import (
    Completion,
    Dialect,
    Format,
    ImagePart,
    Message,
    Options,
    TextPart,
    ToolCall,
)
from tests.codecs.golden import NOW, body, finished, lp, stamp, wire

CREATED = codec.iso_ns(NOW)


def test_chat_and_generate_decode_into_the_neutral_request() -> None:
    png = base64.b64encode(b"\x89PNG").decode()
    req, _ = codec.decode_chat(
        body(
            model="qwen",
            messages=[
                {"role": "user", "content": "What is this?", "images": [png]},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "look", "arguments": {"at": "it"}}}]},
                {"role": "tool", "content": "a cat", "tool_name": "look"},
            ],
            options={"temperature": "0.5", "num_ctx": 8192, "stop": "END", "num_predict": 9},
            format={"type": "object"},
            think="high",
            keep_alive="10m",
            logprobs=True,
            top_logprobs=3,
        )
    )  # fmt: skip
    assert req.dialect is Dialect.OLLAMA
    assert req.truncate  # a prompt longer than the context is cut, not refused
    assert req.messages == (
        Message(role="user", parts=(ImagePart(data=b"\x89PNG"), TextPart("What is this?"))),
        Message(role="assistant", tool_calls=(ToolCall("call00000a", "look", {"at": "it"}),)),
        Message(role="tool", parts=(TextPart("a cat"),), name="look"),
    )
    assert req.options == Options(temperature=0.5, stop=("END",), num_predict=9)
    assert req.format == Format("json_schema", {"type": "object"})
    assert (req.thinking, req.reasoning_effort) == (True, "high")
    assert (req.keep_alive, req.logprobs, req.stream) == (600.0, 3, True)
    gen, _ = codec.decode_generate(
        body(model="qwen", prompt="def f(", suffix="return 1", system="S", context=[1, 2], stream=False)
    )  # fmt: skip
    # a suffix (or raw) prompt has no chat template: it is a completion, as OpenAI's
    assert gen.completion == Completion(
        prompts=("def f(",), suffix="return 1", default_max_tokens=None
    )
    assert (gen.messages, gen.truncate) == ((), True)
    chat, _ = codec.decode_generate(body(model="qwen", prompt="Hi", system="S", context=[1, 2]))
    assert [m.role for m in chat.messages] == ["system", "user"]
    assert (chat.context, chat.completion) == ((1, 2), None)
    load, _ = codec.decode_generate(body(model="qwen", keep_alive=0))
    assert (load.messages, load.keep_alive) == ((), 0.0)  # no prompt: load or unload


def test_bad_requests_are_400s() -> None:
    for raw, message in [
        (body(messages=[]), "model is required"),
        (body(model="m", options={"temperature": "hot"}), "invalid option"),
        (body(model="m", think="very"), "think must be"),
        (body(model="m", format="yaml"), "format must be"),
        (body(model="m", keep_alive="soon"), "keep_alive"),
        (body(model="m", messages=[{"role": "robot"}]), "role"),
        (body(model="m", logprobs=True, top_logprobs=21), "top_logprobs"),
        (body(model="m", top_logprobs=21), "top_logprobs"),  # checked with logprobs off too
        (body(model="m", top_logprobs="lots"), "invalid request"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            codec.decode_chat(raw)
    with pytest.raises(InvalidRequest, match="per-request template"):
        codec.decode_generate(body(model="m", prompt="x", template="{{ .Prompt }}"))
    with pytest.raises(InvalidRequest, match="need the chat template"):
        codec.decode_generate(body(model="m", prompt="x", raw=True, images=["iVBORw0KGgo="]))


def test_a_chat_stream_ends_with_the_timings_in_nanoseconds() -> None:
    req, _ = codec.decode_chat(body(model="qwen", messages=[{"role": "user", "content": "hi"}]))
    s = stamp()
    enc = codec.OllamaEncoder(req, chat=True, stamp=s)
    frames = [
        *enc.waiting(1, None),
        *enc.begin(Begin(39, started=s.perf(), load_s=0.125, prompt=(1, 2))),
        *enc.feed(0, ReasoningDelta("Hm.")),
        *enc.feed(0, TextDelta("Hi", (lp("Hi", -0.25),))),
        *enc.feed(0, ToolCallEvent("abc", "look", '{"at":"it"}')),
        *enc.feed(0, finished("tool_calls")),
        *enc.end(),
    ]

    def msg(**fields: object) -> dict[str, object]:
        return {"model": "qwen", "created_at": CREATED, "message": {"role": "assistant", "content": "", **fields}, "done": False}  # fmt: skip

    hi = msg(content="Hi")
    hi["logprobs"] = [{"token": "Hi", "logprob": -0.25, "top_logprobs": []}]
    final = msg()
    final.update(
        done=True,
        done_reason="stop",
        total_duration=500_000_000,  # one tick of the fake clock after the start
        load_duration=125_000_000,
        prompt_eval_count=39,
        prompt_eval_duration=250_000_000,
        eval_count=7,
        eval_duration=1_500_000_000,
    )
    assert wire(frames) == [
        msg(thinking="Hm."),
        hi,
        msg(tool_calls=[{"function": {"name": "look", "arguments": {"at": "it"}}}]),
        final,
    ]
    full = enc.full()
    assert full["message"]["content"] == "Hi"
    assert full["message"]["thinking"] == "Hm."
    assert full["done_reason"] == "stop"


def test_generate_answers_with_its_context_and_errors_are_one_line() -> None:
    req, _ = codec.decode_generate(body(model="qwen", prompt="Hi", stream=False))
    s = stamp()
    enc = codec.OllamaEncoder(req, chat=False, stamp=s)
    enc.begin(Begin(2, started=s.perf(), prompt=(5, 6)))
    enc.feed(0, TextDelta("Hello"))
    enc.feed(0, finished("length"))
    enc.end()
    full = enc.full()
    assert (full["response"], full["done_reason"], full["context"]) == ("Hello", "length", [5, 6])
    assert wire(enc.error(Unavailable("the engine crashed"))) == [{"error": "the engine crashed"}]


def test_api_chat_names_tool_servers_and_returns_their_calls() -> None:
    req, _ = codec.decode_chat(
        body(model="m", messages=[{"role": "user", "content": "Weather?"}], mcp_servers=["w"])
    )
    assert [u.name for u in req.servers] == ["w"]
    s = stamp()
    enc = codec.OllamaEncoder(req, chat=True, stamp=s)
    enc.begin(Begin(5, s.perf(), 0.0))
    lines = [
        *enc.feed(0, ServerCall("c1", "w", "get_weather", "{}")),
        *enc.feed(0, ServerResult("c1", "w", "get_weather", CallResult("no such city", "error"))),
        *enc.feed(0, finished()),
    ]
    record = {
        "id": "c1",
        "server": "w",
        "name": "get_weather",
        "arguments": "{}",
        "output": "no such city",
        "is_error": True,
    }
    assert [line["message"]["server_tool_calls"] for line in wire(lines)] == [[record]]
    assert enc.full()["message"]["server_tool_calls"] == [record]


def test_a_created_model_s_messages_need_a_role_and_content() -> None:
    ok = codec.decode_create(body(model="m", **{"from": "tiny"}, messages=[{"role": "user", "content": "hi"}]))  # fmt: skip
    assert ok.roles_and_contents == (("user", "hi"),)
    for message in ({"role": "user"}, {"content": "hi"}, {"role": "user", "content": 3}):
        with pytest.raises(InvalidRequest, match="messages"):
            codec.decode_create(body(model="m", **{"from": "tiny"}, messages=[message]))
