"""Ollama's /api/chat and /api/generate as a codec.

Bodies decode into the neutral request (options by Ollama's names, `format` as JSON or a
schema, `think` as a switch or an effort, images as image parts, /api/generate's
`context` before the prompt; a `raw` prompt or one with a `suffix` is a `Completion`,
run without the chat template as OpenAI's completions are). Events encode as Ollama's
NDJSON objects, or one object when `stream` is false; the last one carries the timings
in nanoseconds, as Ollama reports them, and /api/generate's `context`.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Literal

import msgspec

from barrel.config import keep_alive_seconds
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import STAMP, Begin, Data, Frame, Stamp, read_body
from barrel.http.codecs.servers import barrel_servers, call_record
from barrel.pipeline.events import (
    ChatEvent,
    Finished,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    TextDelta,
    ToolCallEvent,
)
from barrel.pipeline.request import (
    ApiRequest,
    Completion,
    Dialect,
    Format,
    ImagePart,
    Message,
    Options,
    Part,
    TextPart,
    Tool,
    ToolCall,
    text,
)
from barrel.values import LoadedModel, TokenLogprob

MAX_TOP_LOGPROBS = 20
EFFORTS = ("low", "medium", "high")


class _Body(msgspec.Struct, kw_only=True):
    model: str = ""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    keep_alive: int | float | str | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = 0


class ChatBody(_Body, kw_only=True):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    mcp_servers: list[Any] | None = None  # Barrel's: configured tool servers to use


class GenerateBody(_Body, kw_only=True):
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] = msgspec.field(default_factory=list)
    context: list[int] = msgspec.field(default_factory=list)


def decode_body(raw: bytes, kind: type[Any]) -> Any:
    try:
        body = read_body(raw, kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    if not getattr(body, "model", ""):
        raise InvalidRequest("model is required")
    return body


# -- model management -------------------------------------------------------------------


class CreateMessage(msgspec.Struct):
    """A message a created model starts its conversations with (Modelfile MESSAGE)."""

    role: Literal["system", "user", "assistant"]
    content: str


class CreateBody(msgspec.Struct, kw_only=True):
    """/api/create's body (Ollama's fields)."""

    model: str = ""
    name: str = ""  # the older field name
    modelfile: str | None = None
    from_: str | None = msgspec.field(default=None, name="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[CreateMessage] | None = None
    quantize: str | None = None
    stream: bool = True

    @property
    def licenses(self) -> tuple[str, ...] | None:
        lic = self.license
        return None if lic is None else (lic,) if isinstance(lic, str) else tuple(lic)

    @property
    def roles_and_contents(self) -> tuple[tuple[str, str], ...]:
        return tuple((m.role, m.content) for m in self.messages or ())


def decode_create(raw: bytes) -> CreateBody:
    try:
        body = read_body(raw, CreateBody)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from None
    if body.quantize:
        raise InvalidRequest("quantize is not supported: Barrel does not requantize models")
    return body


def ps_model(m: LoadedModel) -> dict[str, Any]:
    """One entry of /api/ps: Ollama's fields, then Barrel's (active, running, queued)."""
    expires = m.expires_at
    return {
        "name": m.name,
        "model": m.name,
        "size": m.size,
        "size_vram": 0,
        "digest": m.digest,
        "details": m.details,
        "expires_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
        if expires
        else None,
        "context_length": m.context_length,
        "active": m.active,
        "running": m.running,
        "queued": m.queued,
        "state": "draining" if m.draining else "busy" if m.running else "idle",
    }


# -- chat and generate ------------------------------------------------------------------


def parse_keep_alive(value: Any) -> float | None:
    """Seconds, a duration string, 0 = now, negative = forever; None: the default."""
    if value is None:
        return None
    try:
        return keep_alive_seconds(value, "0")
    except ValueError as exc:
        raise InvalidRequest(f"keep_alive: {exc}") from None


_OPTION_NAMES = frozenset(Options.__struct_fields__)


def options_of(raw: dict[str, Any]) -> Options:
    """The sampling options among Ollama's (the rest, e.g. num_ctx or num_thread, are
    load-time settings: ignored per request, as Ollama does once a model is loaded)."""
    picked = {k: v for k, v in raw.items() if k in _OPTION_NAMES}
    if isinstance(picked.get("stop"), str):
        picked["stop"] = [picked["stop"]]
    try:
        return msgspec.convert(picked, Options, strict=False)  # "0.5" read as 0.5
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid option: {exc}") from None


def _format(fmt: str | dict[str, Any] | None) -> Format:
    if fmt is None or fmt == "":
        return Format()
    if fmt == "json":
        return Format("json_object")
    if isinstance(fmt, dict):
        return Format("json_schema", fmt)
    raise InvalidRequest(f'format must be "json" or a JSON schema, not {fmt!r}')


def _think(value: bool | str | None) -> tuple[bool | None, str | None]:
    if value is None or isinstance(value, bool):
        return value, None
    if value in EFFORTS:
        return True, value
    raise InvalidRequest('think must be true, false, "low", "medium" or "high"')


def _images(raw: Any) -> tuple[Part, ...]:
    if not raw:
        return ()
    if not isinstance(raw, list):
        raise InvalidRequest("images must be a list of base64 strings")
    out: list[Part] = []
    for item in raw:
        try:
            out.append(ImagePart(data=base64.b64decode(str(item), validate=True)))
        except ValueError:
            raise InvalidRequest("an image is not valid base64") from None
    return tuple(out)


def to_messages(raw: list[dict[str, Any]]) -> tuple[Message, ...]:
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest("each message needs a role: system, user, assistant or tool")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise InvalidRequest("a message's content must be a string")
        calls = tuple(
            ToolCall(
                f"call{i:05d}a",
                str((c.get("function") or {}).get("name", "")),
                (c.get("function") or {}).get("arguments", {}),
            )
            for i, c in enumerate(m.get("tool_calls") or [])
            if isinstance(c, dict)
        )
        thinking = m.get("thinking")
        out.append(
            Message(
                role=m["role"],
                parts=(*_images(m.get("images")), *((TextPart(content),) if content else ())),
                tool_calls=calls,
                name=str(m.get("tool_name") or "") if m["role"] == "tool" else "",
                reasoning=thinking if isinstance(thinking, str) else "",
            )
        )
    return tuple(out)


def _tools(raw: list[dict[str, Any]]) -> tuple[Tool, ...]:
    out = []
    for t in raw:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise InvalidRequest("each tool needs function.name")
        params = fn.get("parameters") or {"type": "object"}
        out.append(Tool(str(fn["name"]), str(fn.get("description") or ""), params))
    return tuple(out)


def _common(body: _Body, messages: tuple[Message, ...], **more: Any) -> ApiRequest:
    thinking, effort = _think(body.think)
    if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    logprobs = body.top_logprobs if body.logprobs else None
    return ApiRequest(
        model=body.model,
        dialect=Dialect.OLLAMA,
        truncate=True,
        messages=messages,
        format=_format(body.format),
        options=options_of(body.options),
        logprobs=logprobs,
        stream=body.stream,
        keep_alive=parse_keep_alive(body.keep_alive),
        thinking=thinking,
        reasoning_effort=effort,
        **more,
    )


def decode_chat(raw: bytes, conversation: str | None = None) -> tuple[ApiRequest, ChatBody]:
    """/api/chat; no messages means load (or, with keep_alive 0, unload) the model."""
    body: ChatBody = decode_body(raw, ChatBody)
    req = _common(
        body,
        to_messages(body.messages),
        tools=_tools(body.tools),
        servers=barrel_servers(body.mcp_servers),
        conversation=conversation,
    )
    return req, body


def decode_generate(raw: bytes, conversation: str | None = None) -> tuple[ApiRequest, GenerateBody]:
    """/api/generate; no prompt (and no suffix) means load or unload the model."""
    body: GenerateBody = decode_body(raw, GenerateBody)
    if not body.prompt and not body.suffix:
        return _common(body, ()), body
    if body.template and not body.raw and not body.suffix:
        raise InvalidRequest("a per-request template is not supported; use raw or a Modelfile")
    if body.raw or body.suffix:
        if body.images:
            raise InvalidRequest(
                "images and audio need the chat template: they cannot go with raw or suffix"
            )
        given = Completion(prompts=(body.prompt,), suffix=body.suffix, default_max_tokens=None)
        return _common(body, (), completion=given, conversation=conversation), body
    messages: list[Message] = []
    if body.system is not None:
        messages.append(text("system", body.system))
    messages.append(Message(role="user", parts=(*_images(body.images), TextPart(body.prompt))))
    req = _common(body, tuple(messages), context=tuple(body.context), conversation=conversation)
    return req, body


# -- response ----------------------------------------------------------------------------


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def iso_ns(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


def logprobs_of(lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in lp.top],
        }
        for lp in lps
    ]


def _call(event: ToolCallEvent) -> dict[str, Any]:
    return {"function": {"name": event.name, "arguments": json.loads(event.arguments)}}


# Ollama says "stop" after tool calls and "length" for a full context too
_DONE_REASONS = {"tool_calls": "stop", "context": "length"}


class OllamaEncoder:
    def __init__(self, req: ApiRequest, *, chat: bool, stamp: Stamp = STAMP) -> None:
        self.name = req.model
        self.chat = chat
        self.stamp = stamp
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[dict[str, Any]] = []
        # tool-server calls Barrel ran, with their results (Barrel's `server_tool_calls`)
        self.server_calls: dict[str, ServerCall] = {}
        self.server_records: list[dict[str, Any]] = []
        self.lps: list[TokenLogprob] = []
        self.begun = Begin(0)
        self.finished: Finished | None = None

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return []

    def begin(self, begin: Begin) -> list[Frame]:
        self.begun = begin
        return []

    def _chunk(
        self, content: str = "", thinking: str = "", calls: list[Any] | None = None
    ) -> dict[str, Any]:
        created = iso_ns(self.stamp.now())
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"model": self.name, "created_at": created, "message": message, "done": False}
        out: dict[str, Any] = {
            "model": self.name,
            "created_at": created,
            "response": content,
            "done": False,
        }
        if thinking:
            out["thinking"] = thinking
        return out

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            self.lps.extend(event.logprobs)
            if event.text or event.logprobs:
                chunk = self._chunk(content=event.text)
                if event.logprobs:
                    chunk["logprobs"] = logprobs_of(event.logprobs)
                return [Data(chunk)]
        elif isinstance(event, ReasoningDelta):
            self.thinking.append(event.text)
            if event.text:
                return [Data(self._chunk(thinking=event.text))]
        elif isinstance(event, ToolCallEvent):
            call = _call(event)
            self.calls.append(call)
            return [Data(self._chunk(calls=[call]))]
        elif isinstance(event, ServerCall):
            self.server_calls[event.id] = event
        elif isinstance(event, ServerResult) and event.id in self.server_calls:
            record = call_record(self.server_calls[event.id], event)
            self.server_records.append(record)
            chunk = self._chunk()  # only /api/chat names servers
            chunk["message"]["server_tool_calls"] = [record]
            return [Data(chunk)]
        elif isinstance(event, Finished):
            self.finished = event
            self.lps.extend(event.logprobs)
        return []

    def _final(self, body: dict[str, Any], leftover: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        fin = self.finished
        if fin is None:
            raise BarrelError("the generation ended without a result")
        if leftover:
            body["logprobs"] = logprobs_of(leftover)
        body["done"] = True
        body["done_reason"] = _DONE_REASONS.get(fin.reason, fin.reason)
        b = self.begun
        body.update(
            {
                "total_duration": ns(self.stamp.perf() - b.started),
                "load_duration": ns(b.load_s),
                "prompt_eval_count": b.prompt_tokens,
                "prompt_eval_duration": ns(fin.prefill_s),
                "eval_count": fin.usage.completion_tokens,
                "eval_duration": ns(fin.decode_s),
            }
        )
        if not self.chat:
            # the prompt and the answer: sent back, it continues this conversation
            body["context"] = list(fin.context or b.prompt)
        return body

    def end(self) -> list[Frame]:
        leftover = self.finished.logprobs if self.finished is not None else ()
        return [Data(self._final(self._chunk(), leftover))]

    def full(self) -> dict[str, Any]:
        body = self._chunk("".join(self.text), "".join(self.thinking), self.calls)
        if self.server_records and self.chat:
            body["message"]["server_tool_calls"] = self.server_records
        return self._final(body, tuple(self.lps))

    def error(self, err: BarrelError) -> list[Frame]:
        return [Data({"error": err.message})]
