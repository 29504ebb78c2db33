"""Anthropic's Messages API as a codec.

Content blocks decode into neutral messages (tool results become tool messages ahead of
the user's text; images become image parts; thinking blocks are passed back as the
turn's reasoning). Events encode as Anthropic's content blocks, or as the named SSE
events of a stream, with pings while the request waits. As in Anthropic's API, the usage
counts add up to the prompt (count_tokens): `cache_read_input_tokens` is the part taken
from the KV cache, `input_tokens` the part computed; `cache_creation_input_tokens` is 0
(what is computed is kept for the next turn at no extra cost).
cache_control breakpoints are pinned-prefix hints: the prompt up to the last marked
message is held in a pinned sequence (without one, the system + tools head is).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import msgspec

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import STAMP, Begin, Data, Frame, Stamp, constraints, read_body
from barrel.http.codecs.servers import anthropic_servers, server_round
from barrel.http.errors import error_body
from barrel.pipeline.events import (
    ChatEvent,
    Finished,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.request import (
    ApiRequest,
    Dialect,
    ImagePart,
    Message,
    Options,
    Part,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    text,
)
from barrel.values import Usage


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
    # llama-server's extensions (its /v1/messages takes its own sampling fields too)
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format`: structured output
    output_format: dict[str, Any] | None = None  # the beta's name for that format
    mcp_servers: list[Any] | None = None  # the MCP connector: configured servers only


# -- request: Anthropic blocks -> neutral messages ---------------------------------------


def _image(block: dict[str, Any]) -> ImagePart:
    source = block.get("source") or {}
    if not isinstance(source, dict):
        raise InvalidRequest("an image block needs a source")
    if source.get("type") == "base64":
        try:
            data = base64.b64decode(str(source.get("data", "")), validate=True)
        except ValueError:
            raise InvalidRequest("image.source.data is not valid base64") from None
        return ImagePart(data=data, media_type=str(source.get("media_type", "")))
    return ImagePart(url=str(source.get("url", "")))


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
            raise InvalidRequest(f"{where}: this model reads text only; images are not supported")
        else:
            raise InvalidRequest(f"{where}: unsupported content block type {kind!r}")
    return "\n".join(parts)


def _user_turn(content: Any) -> list[Message]:
    """One user turn: tool results become tool messages, ahead of the text and images."""
    if isinstance(content, str):
        return [text("user", content)]
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of content blocks")
    out: list[Message] = []
    said: list[str] = []
    images: list[Part] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            said.append(str(block.get("text", "")))
        elif kind == "tool_result":
            result = _text_of(block.get("content") or "", "tool_result.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append(
                Message(
                    role="tool",
                    parts=(TextPart(result),) if result else (),
                    tool_call_id=str(block.get("tool_use_id", "")),
                )
            )
        elif kind == "image":
            images.append(_image(block))
        else:
            raise InvalidRequest(f"unsupported content block type {kind!r} in a user message")
    if said or images:
        joined = "\n".join(said)
        out.append(Message(role="user", parts=(*images, *((TextPart(joined),) if said else ()))))
    return out


def _assistant_turn(content: Any) -> list[Message]:
    """One assistant turn; where it holds rounds of server calls (`mcp_tool_use` and
    `mcp_tool_result` blocks), each round becomes the assistant's calls and their results,
    as the model saw them."""
    if isinstance(content, str):
        return [text("assistant", content)]
    if not isinstance(content, list):
        raise InvalidRequest("message content must be a string or a list of content blocks")
    said: list[str] = []
    calls: list[ToolCall] = []
    reasoning = ""
    out: list[Message] = []
    server: list[ToolCall] = []
    results: dict[str, str] = {}
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in ("mcp_tool_use", "mcp_tool_result") and server:
            out += _round(said, server, results)
            said, server, results = [], [], {}
        if kind == "mcp_tool_use":
            cid, name = str(block.get("id", "")), str(block.get("name", ""))
            server.append(ToolCall(cid, name, block.get("input") or {}))
        elif kind == "mcp_tool_result":
            result = _text_of(block.get("content") or "", "mcp_tool_result.content")
            results[str(block.get("tool_use_id", ""))] = result
        elif kind == "text":
            said.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(
                ToolCall(
                    str(block.get("id", "")), str(block.get("name", "")), block.get("input") or {}
                )
            )
        elif kind == "thinking":
            reasoning = str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # opaque by definition: nothing a local model can read
        else:
            raise InvalidRequest(f"unsupported content block type {kind!r} in an assistant message")
    if server:
        out += _round(said, server, results)
        said = []
    joined = "".join(said)
    if joined or calls or reasoning or not out:
        out.append(
            Message(
                role="assistant",
                parts=(TextPart(joined),) if joined else (),
                tool_calls=tuple(calls),
                reasoning=reasoning,
            )
        )
    return out


def _round(said: list[str], server: list[ToolCall], results: dict[str, str]) -> list[Message]:
    """A round of server calls (the text before it, the calls, their results)."""
    first, *rest = server_round([(call, results.get(call.id, "")) for call in server])
    joined = "".join(said)
    return [msgspec.structs.replace(first, parts=(TextPart(joined),) if joined else ()), *rest]


def _cached(content: Any) -> bool:
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("cache_control") for b in content
    )


def to_messages(body: MessagesBody) -> tuple[tuple[Message, ...], int]:
    """Neutral messages, and how many of them end at the last cache_control breakpoint
    (0 when there is none among the messages)."""
    out: list[Message] = []
    pin = 0
    if body.system:
        out.append(text("system", _text_of(body.system, "system")))
    for m in body.messages:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user_turn(m.get("content", ""))
        elif role == "assistant":
            out += _assistant_turn(m.get("content", ""))
        elif role == "system":  # not Anthropic's, but clients send it: treat as system text
            out.append(text("system", _text_of(m.get("content", ""), "system")))
        else:
            raise InvalidRequest("messages: each role must be user or assistant")
        if _cached(m.get("content")):
            pin = len(out)
    return tuple(out), pin


def to_tools(tools: list[dict[str, Any]]) -> tuple[Tool, ...]:
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "mcp_toolset":
            continue  # the MCP connector's toolset: its server is in mcp_servers
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "name" not in t:
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"tools: only custom tools are supported, not {kind!r}")
        schema = t.get("input_schema") or {"type": "object"}
        out.append(Tool(str(t["name"]), str(t.get("description", "")), schema))
    return tuple(out)


def _tool_choice(choice: dict[str, Any] | None) -> tuple[ToolChoice, bool]:
    if choice is None:
        return ToolChoice(), True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool":
        if not choice.get("name"):
            raise InvalidRequest("tool_choice.name is required when type is tool")
        return ToolChoice("function", str(choice["name"])), parallel
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


def decode(
    raw: bytes, *, counting: bool, conversation: str | None = None
) -> tuple[ApiRequest, MessagesBody]:
    """Everything that can be checked without the model, before any queueing or
    loading (count_tokens needs no max_tokens); and the body, for the encoder."""
    try:
        body = read_body(raw, MessagesBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    if not body.model:
        raise InvalidRequest("model: Field required")
    if not body.messages:
        raise InvalidRequest("messages: at least one message is required")
    if not counting and (body.max_tokens is None or body.max_tokens < 1):
        raise InvalidRequest("max_tokens: Field required (a positive integer)")
    messages, pin = to_messages(body)
    choice, parallel = _tool_choice(body.tool_choice)
    thinking, budget = _thinking(body.thinking, body.max_tokens)
    user_id = (body.metadata or {}).get("user_id")
    # Anthropic's prefill: a final assistant message with text is continued, not closed
    last = messages[-1] if messages else None
    prefill = (
        last is not None and last.role == "assistant" and bool(last.text) and not last.tool_calls
    )
    options = Options(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repeat_penalty=body.repeat_penalty,
        seed=body.seed,
    )
    return ApiRequest(
        model=body.model,
        dialect=Dialect.ANTHROPIC,
        messages=messages,
        tools=to_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        servers=anthropic_servers(body.mcp_servers),
        options=options,
        max_tokens=body.max_tokens,
        # the request's stop sequences come after the model's stored ones
        stop=tuple(body.stop_sequences),
        stream=body.stream,
        thinking=thinking,
        reasoning_budget=budget or None,
        conversation=conversation,
        user=user_id if isinstance(user_id, str) else None,
        pin_messages=pin,
        continue_final=prefill and not thinking,
        format=constraints.anthropic(body.output_config, body.output_format),
    ), body


# -- response: pipeline events -> Anthropic blocks ---------------------------------------


def usage_of(u: Usage) -> dict[str, int]:
    """input + cache read + cache creation = the prompt, as Anthropic counts them."""
    return {
        "input_tokens": u.prompt_tokens - u.prompt_reused,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.prompt_reused,
        "cache_creation_input_tokens": 0,
    }


def _stop(fin: Finished) -> tuple[str, str | None]:
    if fin.reason == "tool_calls":
        return "tool_use", None
    if fin.reason == "length":
        return "max_tokens", None
    if fin.reason == "context":
        return "model_context_window_exceeded", None
    if fin.stop_sequence:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def _tool_id(event: ToolCallEvent) -> str:
    return event.id if event.id.startswith("toolu_") else f"toolu_{event.id}"


def signature(thinking: str) -> str:
    """Opaque, like Anthropic's; it only lets a client pass the block back."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


PING = Data({"type": "ping"}, "ping")


def _server_id(cid: str) -> str:
    return cid if cid.startswith("mcptoolu_") else f"mcptoolu_{cid}"


class MessagesEncoder:
    """The message and its content blocks, built as events come; a stream opens and
    closes blocks as the kind of delta changes."""

    def __init__(self, req: ApiRequest, stamp: Stamp = STAMP) -> None:
        self.message: dict[str, Any] = {
            "id": stamp.ids("msg_"),
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {},
        }
        self.content: list[dict[str, Any]] = self.message["content"]
        self.index = -1
        self.kind: str | None = None
        self.pinged = False
        self.finished = False

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return [PING]

    def begin(self, begin: Begin) -> list[Frame]:
        usage = {
            "input_tokens": begin.prompt_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }
        start = {**self.message, "content": [], "usage": usage}
        return [Data({"type": "message_start", "message": start}, "message_start")]

    def _open(self, block: dict[str, Any]) -> list[Frame]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        self.content.append(block)
        start = {"type": "content_block_start", "index": self.index, "content_block": dict(block)}
        out.append(Data(start, "content_block_start"))
        if not self.pinged:
            self.pinged = True
            out.append(PING)
        return out

    def _delta(self, delta: dict[str, Any]) -> Data:
        return Data(
            {"type": "content_block_delta", "index": self.index, "delta": delta},
            "content_block_delta",
        )

    def _close(self) -> list[Frame]:
        if self.kind is None:
            return []
        out: list[Frame] = []
        if self.kind == "thinking":
            block = self.content[-1]
            block["signature"] = signature(block["thinking"])
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        out.append(Data({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
        self.kind = None
        return out

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        out: list[Frame] = []
        if isinstance(event, ReasoningDelta) and event.text:
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.content[-1]["thinking"] += event.text
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta) and event.text:
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            self.content[-1]["text"] += event.text
            out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):  # then input_json_delta pieces as written
            call = ToolCallEvent(event.id, event.name, "")
            out += self._open({"type": "tool_use", "id": _tool_id(call), "name": event.name})
            self.content[-1]["input"] = {}
        elif isinstance(event, ToolArgsDelta) and event.text and self.kind == "tool_use":
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
        elif isinstance(event, ToolCallEvent):
            if not event.streamed or self.kind != "tool_use":
                block = {"type": "tool_use", "id": _tool_id(event), "name": event.name}
                out += self._open({**block, "input": {}})
                piece = {"type": "input_json_delta", "partial_json": event.arguments}
                out.append(self._delta(piece))
            self.content[-1]["input"] = json.loads(event.arguments)
            out += self._close()
        elif isinstance(event, ServerCall):
            out += self._open(
                {
                    "type": "mcp_tool_use",
                    "id": _server_id(event.id),
                    "name": event.name,
                    "server_name": event.server,
                    "input": {},
                }
            )
            out.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
            self.content[-1]["input"] = json.loads(event.arguments or "{}")
            out += self._close()
        elif isinstance(event, ServerResult):
            out += self._open(
                {
                    "type": "mcp_tool_result",
                    "tool_use_id": _server_id(event.id),
                    "is_error": event.result.error,
                    "content": [{"type": "text", "text": event.result.output}],
                }
            )
            out += self._close()
        elif isinstance(event, Finished):
            out += self._close()
            self.finished = True
            reason, sequence = _stop(event)
            self.message["stop_reason"], self.message["stop_sequence"] = reason, sequence
            self.message["usage"] = usage_of(event.usage)
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_of(event.usage),
            }
            out += [Data(delta, "message_delta"), Data({"type": "message_stop"}, "message_stop")]
        return out

    def end(self) -> list[Frame]:
        if not self.finished:
            raise BarrelError("the generation ended without a result")
        return []

    def full(self) -> dict[str, Any]:
        return self.message

    def error(self, err: BarrelError) -> list[Frame]:
        status = 529 if err.status == 503 else err.status
        envelope = error_body(Dialect.ANTHROPIC, status, err.code, err.message_for("anthropic"))
        assert isinstance(envelope, dict)
        return [Data(envelope, "error")]
