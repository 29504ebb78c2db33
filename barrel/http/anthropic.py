"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

Requests decode into the chat pipeline's neutral `ChatRequest` (content blocks become
OpenAI-shaped messages); its events encode as Anthropic's content blocks, or as the
named SSE events of a stream. `input_tokens` counts the whole prompt (so it equals
count_tokens); `cache_read_input_tokens` is the part taken from the KV cache and
`cache_creation_input_tokens` the part prefilled and kept for the next turn.
cache_control breakpoints are pinned-prefix hints: the prompt up to the last marked
message is held in a pinned sequence (without one, the system + tools head is).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from barrel.actors.lifecycle import Lease
from barrel.engine.types import Usage
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.errors import Dialect, error_body
from barrel.http.keys import LIFECYCLE, METRICS
from barrel.http.leases import check_limits, prepare_on, template_of, with_model_messages
from barrel.http.ollama_gen import sampling_from
from barrel.http.sse import SseWriter
from barrel.pipeline.chat import (
    ChatRequest,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallEvent,
    run,
)
from barrel.pipeline.session import derive_session

routes = web.RouteTableDef()

IMAGE_REFUSAL = "this model reads text only; image blocks are not supported"


class MessagesBody(msgspec.Struct, kw_only=True):
    model: str = ""
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    max_tokens: int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] = msgspec.field(default_factory=list)
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


async def _decode(request: web.Request, *, counting: bool) -> MessagesBody:
    try:
        body = msgspec.json.decode(await request.read() or b"{}", type=MessagesBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    if not body.model:
        raise InvalidRequest("model: Field required")
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required")
    if not counting and (body.max_tokens is None or body.max_tokens < 1):
        raise InvalidRequest("max_tokens: Field required (a positive integer)")
    check_limits(request, body.messages, body.tools)
    return body


# -- request: Anthropic blocks -> pipeline messages --------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A string or a list of text blocks (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content blocks")
    parts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind == "image":
            raise InvalidRequest(IMAGE_REFUSAL)
        else:
            raise InvalidRequest(f"{where}: unsupported content block type {kind!r}")
    return "\n".join(parts)


def _user_turn(content: Any) -> list[dict[str, Any]]:
    """One user message: tool results become tool messages, ahead of the text."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            result = _text_of(block.get("content") or "", "tool_result.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": str(block.get("tool_use_id", "")),
                    "content": result,
                }
            )
        elif kind == "image":
            raise InvalidRequest(IMAGE_REFUSAL)
        else:
            raise InvalidRequest(f"unsupported content block type {kind!r} in a user message")
    if text:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _assistant_turn(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of content blocks")
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": {
                        "name": str(block.get("name", "")),
                        "arguments": block.get("input") or {},
                    },
                }
            )
        elif kind == "thinking":
            msg["reasoning_content"] = str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # opaque by definition: nothing a local model can read
        else:
            raise InvalidRequest(f"unsupported content block type {kind!r} in an assistant message")
    msg["content"] = "".join(text)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _cached(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("cache_control") for b in content
    )


def to_messages(body: MessagesBody) -> tuple[list[dict[str, Any]], int]:
    """The pipeline's messages, and how many of them end at the last cache_control
    breakpoint (0 when there is none among the messages)."""
    out: list[dict[str, Any]] = []
    pin = 0
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for m in body.messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user_turn(m.get("content", ""))
        elif role == "assistant":
            out.append(_assistant_turn(m.get("content", "")))
        elif role == "system":  # not Anthropic's, but clients send it: treat as system text
            out.append({"role": "system", "content": _text_of(m.get("content", ""), "system")})
        else:
            raise InvalidRequest("messages: each role must be user or assistant")
        if _cached(m.get("content")):
            pin = len(out)
    return out, pin


def to_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        if t.get("type") not in (None, "custom") or "name" not in t:
            raise InvalidRequest(f"tools: only custom tools are supported, not {t.get('type')!r}")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object"},
                },
            }
        )
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any], bool]:
    if choice is None:
        return "auto", True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind), parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not choice.get("name"):
            raise InvalidRequest("tool_choice.name is required when type is tool")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("tool_choice.type must be auto, any, tool or none")


def _thinking(value: dict[str, Any] | None, max_tokens: int | None) -> tuple[bool | None, int]:
    if value is None:
        return None, 0
    kind = value.get("type")
    if kind == "disabled":
        return False, 0
    if kind == "adaptive":  # the model decides how long to think: the default budget
        return True, 0
    if kind != "enabled":
        raise InvalidRequest("thinking.type must be enabled, adaptive or disabled")
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or budget < 1:
        raise InvalidRequest("thinking.budget_tokens must be a positive integer")
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequest("max_tokens must be greater than thinking.budget_tokens")
    return True, budget


def chat_request(body: MessagesBody) -> tuple[ChatRequest, int]:
    """Everything that can be checked without the model, before any queueing or
    loading; and how many messages end at the last cache_control breakpoint."""
    messages, pin = to_messages(body)
    choice, parallel = _tool_choice(body.tool_choice)
    thinking, budget = _thinking(body.thinking, body.max_tokens)
    req = ChatRequest(
        messages,
        tools=to_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=body.max_tokens,
        stop=tuple(body.stop_sequences),
        thinking=thinking,
    )
    if budget:
        req.reasoning_budget = budget
    return req, pin


def for_model(
    req: ChatRequest, pin: int, body: MessagesBody, lease: Lease, request: web.Request
) -> ChatRequest:
    """The model's stored messages and parameters under the request's, and the session."""
    spec = lease.spec
    req.messages, before = with_model_messages(lease, req.messages)
    knobs = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    req.sampling, _, stop = sampling_from(
        {k: v for k, v in knobs.items() if v is not None}, spec.parameters
    )
    req.stop = (*stop, *req.stop)
    user_id = (body.metadata or {}).get("user_id")
    req.session = derive_session(
        spec.name,
        req.messages,
        request.headers.get("x-conversation-id"),
        user_id if isinstance(user_id, str) else None,
    )
    if pin:  # a cache_control breakpoint inside the conversation: pin up to it
        req.pin_messages = before + pin
    return req


# -- response: pipeline events -> Anthropic blocks ---------------------------------------


def _usage(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.prompt_reused,
        "cache_creation_input_tokens": u.prompt_computed,
    }


def _stop(fin: Finished) -> tuple[str, str | None]:
    if fin.reason == "tool_calls":
        return "tool_use", None
    if fin.reason == "length":
        return "max_tokens", None
    if fin.stop_sequence:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def _tool_id(event: ToolCallEvent) -> str:
    return event.id if event.id.startswith("toolu_") else f"toolu_{event.id}"


def _signature(thinking: str) -> str:
    """Opaque, like Anthropic's; it only lets a client pass the block back."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _message(name: str, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": name,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


async def _collect(events: AsyncIterator[Any], name: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []

    def last(kind: str) -> dict[str, Any]:
        if not content or content[-1]["type"] != kind:
            content.append({"type": kind, kind: ""})
        return content[-1]

    async for event in events:
        if isinstance(event, ReasoningDelta) and event.text:
            last("thinking")["thinking"] += event.text
        elif isinstance(event, TextDelta) and event.text:
            last("text")["text"] += event.text
        elif isinstance(event, ToolCallEvent):
            content.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(event),
                    "name": event.name,
                    "input": json.loads(event.arguments),
                }
            )
        elif isinstance(event, Finished):
            for block in content:
                if block["type"] == "thinking":
                    block["signature"] = _signature(block["thinking"])
            out = _message(name, content, _usage(event.usage))
            out["stop_reason"], out["stop_sequence"] = _stop(event)
            return out
    raise BarrelError("the generation ended without a result")


def _ping(sse: SseWriter) -> Callable[..., None]:
    return lambda *_: sse.soon(sse.send({"type": "ping"}, "ping"))


class _Blocks:
    """Opens and closes content blocks as the kind of delta changes."""

    def __init__(self, sse: SseWriter) -> None:
        self.sse = sse
        self.index = -1
        self.kind: str | None = None
        self.thought = ""
        self.pinged = False

    async def open(self, block: dict[str, Any]) -> None:
        await self.close()
        self.index += 1
        self.kind = block["type"]
        await self.sse.send(
            {"type": "content_block_start", "index": self.index, "content_block": block},
            "content_block_start",
        )
        if not self.pinged:
            self.pinged = True
            await self.sse.send({"type": "ping"}, "ping")

    async def delta(self, delta: dict[str, Any]) -> None:
        await self.sse.send(
            {"type": "content_block_delta", "index": self.index, "delta": delta},
            "content_block_delta",
        )

    async def close(self) -> None:
        if self.kind is None:
            return
        if self.kind == "thinking":
            await self.delta({"type": "signature_delta", "signature": _signature(self.thought)})
            self.thought = ""
        await self.sse.send(
            {"type": "content_block_stop", "index": self.index}, "content_block_stop"
        )
        self.kind = None

    async def feed(self, event: Any) -> None:
        if isinstance(event, ReasoningDelta) and event.text:
            if self.kind != "thinking":
                await self.open({"type": "thinking", "thinking": "", "signature": ""})
            self.thought += event.text
            await self.delta({"type": "thinking_delta", "thinking": event.text})
        elif isinstance(event, TextDelta) and event.text:
            if self.kind != "text":
                await self.open({"type": "text", "text": ""})
            await self.delta({"type": "text_delta", "text": event.text})
        elif isinstance(event, ToolCallEvent):
            block = {"type": "tool_use", "id": _tool_id(event), "name": event.name, "input": {}}
            await self.open(block)
            await self.delta({"type": "input_json_delta", "partial_json": event.arguments})
            await self.close()


async def _stream(sse: SseWriter, events: AsyncIterator[Any], name: str, prompt: int) -> None:
    start_usage = {
        "input_tokens": prompt,
        "output_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    await sse.send(
        {"type": "message_start", "message": _message(name, [], start_usage)}, "message_start"
    )
    blocks = _Blocks(sse)
    async for event in events:
        if isinstance(event, Finished):
            await blocks.close()
            reason, sequence = _stop(event)
            await sse.send(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(event.usage),
                },
                "message_delta",
            )
            await sse.send({"type": "message_stop"}, "message_stop")
            return
        await blocks.feed(event)
    raise BarrelError("the generation ended without a result")


async def _failed(sse: SseWriter | None, err: BarrelError) -> web.StreamResponse:
    """An error after pings or events went out is an `event: error`; before, it is a
    plain response in Anthropic's envelope (re-raised for the middleware)."""
    if sse is not None:
        await sse.settle()
    if sse is None or not sse.started:
        raise err
    status = 529 if err.status == 503 else err.status
    envelope = error_body(Dialect.ANTHROPIC, status, err.code, err.message)
    assert isinstance(envelope, dict)
    await sse.send(envelope, "error")
    return await sse.close()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = await _decode(request, counting=False)
    req, pin = chat_request(body)
    lifecycle = request.app[LIFECYCLE]
    sse = SseWriter(request) if body.stream else None
    ping = _ping(sse) if sse is not None else None
    try:
        lease = await lifecycle.acquire(body.model, None, on_queued=ping, on_loading=ping)
    except BarrelError as err:  # e.g. a queue timeout after pings went out
        return await _failed(sse, err)
    try:
        req = for_model(req, pin, body, lease, request)
        prep = await prepare_on(lease, req, await template_of(request, lease))
        events = run(lease.engine, req, prep, request.app[METRICS].pipeline_timings)
        if sse is None:
            return web.json_response(await _collect(events, body.model))
        await sse.settle()
        await _stream(sse, events, body.model, len(prep.prompt))
    except BarrelError as err:
        return await _failed(sse, err)
    finally:
        await lifecycle.release(lease)
    return await sse.close()


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await _decode(request, counting=True)
    req, pin = chat_request(body)
    lifecycle = request.app[LIFECYCLE]
    lease = await lifecycle.unqueued(body.model)  # counting does not wait behind generation
    try:
        req = for_model(req, pin, body, lease, request)
        prep = await prepare_on(lease, req, await template_of(request, lease))
    finally:
        await lifecycle.release(lease)
    return web.json_response({"input_tokens": len(prep.prompt)})
