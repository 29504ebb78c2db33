"""OpenAI's chat completions as a codec.

Requests decode into the neutral request: developer becomes system, text parts are
joined, image and `input_audio` parts become image and audio parts (read by models
whose projector takes them, a 400 for others), assistant tool-call arguments are parsed
from their JSON strings. Events encode as a
`chat.completion`, or as `chat.completion.chunk` frames ending with `[DONE]`: the role
chunk goes out with the first event, reasoning as `reasoning_content` (as llama-server
and DeepSeek send it), tool calls as whole calls (one delta each), `n > 1` as choices of
parallel sequences, `usage.prompt_tokens_details.cached_tokens` as the prompt tokens
taken from the KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import DONE, STAMP, Begin, Data, Frame, Stamp
from barrel.http.codecs.openai_common import (
    FINGERPRINT,
    MAX_TOP_LOGPROBS,
    Knobs,
    check_knobs,
    decode_json,
    error_frame,
    finish_reason,
    format_of,
    include_usage,
    logit_bias_of,
    lora_of,
    options_of,
    progress,
    token_logprobs,
    usage_of,
)
from barrel.http.codecs.servers import barrel_servers, call_record
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
    AudioPart,
    Dialect,
    ImagePart,
    Message,
    Part,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
)
from barrel.values import TokenLogprob, Usage

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ChatCompletionBody(Knobs, kw_only=True):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's and llama-server's assistant prefill
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # default: not continue_final_message
    # Barrel's: configured tool servers whose tools the model may call (run by Barrel)
    mcp_servers: list[Any] | None = None


# -- request -----------------------------------------------------------------------------

TEXT_PARTS = ("text", "input_text", "output_text", "refusal")
IMAGE_PARTS = ("image_url", "input_image")
REFUSED_PARTS = ("file", "input_file")


def _audio(part: dict[str, Any], param: str) -> AudioPart:
    """`{"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}`."""
    inner = part.get("input_audio")
    if not isinstance(inner, dict) or not isinstance(inner.get("data"), str):
        raise InvalidRequest(f"{param}.input_audio.data must be a base64 string", param=param)
    fmt = inner.get("format", "")
    if not isinstance(fmt, str):
        raise InvalidRequest(f"{param}.input_audio.format must be a string", param=param)
    return AudioPart(encoded=inner["data"], format=fmt.lower())


def parts_of(content: Any, param: str) -> tuple[Part, ...]:
    """A message's content: a string, or text, image and audio parts (files are
    refused)."""
    if content is None or content == "":
        return ()
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or a list of parts", param=param)
    out: list[Part] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            assert isinstance(part, dict)
            out.append(TextPart(str(part.get("text", part.get("refusal", "")))))
        elif kind in IMAGE_PARTS:
            assert isinstance(part, dict)
            url = part.get("image_url")
            url = url.get("url", "") if isinstance(url, dict) else url
            out.append(ImagePart(url=str(url or "")))
        elif kind == "input_audio":
            assert isinstance(part, dict)
            out.append(_audio(part, f"{param}[{i}]"))
        elif kind in REFUSED_PARTS:
            raise InvalidRequest(
                f"this model reads text only; {kind} parts are not supported",
                param=f"{param}[{i}]",
            )
        else:
            raise InvalidRequest(f"unknown content part type {kind!r}", param=f"{param}[{i}]")
    return tuple(out)


def text_of(content: Any, param: str) -> str:
    """Text-only content (system prompts, tool results): image and audio parts are
    refused."""
    parts = parts_of(content, param)
    if any(not isinstance(p, TextPart) for p in parts):
        raise InvalidRequest(f"{param} must be text", param=param)
    return "".join(p.text for p in parts if isinstance(p, TextPart))


def arguments_of(raw: Any, param: str) -> Any:
    """Tool-call arguments come as a JSON string; the pipeline wants the object."""
    if not isinstance(raw, str):
        return raw if raw is not None else {}
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise InvalidRequest(f"{param} must be a JSON object string", param=param) from None


def _calls(raw: Any, param: str) -> tuple[ToolCall, ...]:
    if not isinstance(raw, list):
        raise InvalidRequest(f"{param} must be a list", param=param)
    out = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise InvalidRequest("a tool call needs function.name", param=f"{param}[{i}]")
        assert isinstance(call, dict)
        arguments = arguments_of(fn.get("arguments"), f"{param}[{i}].function.arguments")
        out.append(ToolCall(str(call.get("id", f"call_{i}")), str(fn["name"]), arguments))
    return tuple(out)


def to_messages(raw: list[dict[str, Any]]) -> tuple[Message, ...]:
    """OpenAI's messages -> neutral ones (developer becomes system)."""
    out: list[Message] = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        where = f"{param}.content"
        if role in ("system", "developer"):
            out.append(Message(role="system", parts=_text_parts(text_of(content, where))))
        elif role == "user":
            out.append(Message(role="user", parts=parts_of(content, where)))
        elif role == "assistant":
            reasoning = m.get("reasoning_content")
            out.append(
                Message(
                    role="assistant",
                    parts=_text_parts(text_of(content, where)),
                    tool_calls=_calls(m["tool_calls"], f"{param}.tool_calls")
                    if m.get("tool_calls")
                    else (),
                    reasoning=reasoning if isinstance(reasoning, str) else "",
                )
            )
        elif role in ("tool", "function"):
            out.append(
                Message(
                    role="tool",
                    parts=_text_parts(text_of(content, where)),
                    tool_call_id=str(m.get("tool_call_id", "")),
                    name=str(m.get("name") or ""),
                )
            )
        else:
            raise InvalidRequest(
                "role must be system, developer, user, assistant or tool", param=f"{param}.role"
            )
    return tuple(out)


def _text_parts(text: str) -> tuple[Part, ...]:
    return (TextPart(text),) if text else ()


def to_tools(tools: list[dict[str, Any]]) -> tuple[Tool, ...]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest("only function tools are supported", param=f"tools[{i}]")
        if not isinstance(fn, dict):
            raise InvalidRequest("only function tools are supported", param=f"tools[{i}]")
        if not fn.get("name"):
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].function")
        params = fn.get("parameters") or {"type": "object"}
        out.append(Tool(str(fn["name"]), str(fn.get("description") or ""), params))
    return tuple(out)


def tool_choice_of(choice: Any, *, nested: bool = True) -> ToolChoice:
    """auto, none, required or a function: `{"type": "function", "function": {"name"}}`
    (chat completions), or with the name beside the type (`nested=False`, responses,
    where `{"type": "mcp", "server_label", "name"}` names a tool server's tool too).
    Whether the function is among the tools is the pipeline's rule (generation.check)."""
    if choice is None:
        return ToolChoice()
    if choice in ("auto", "none", "required"):
        return ToolChoice(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if nested else choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice must name a function", param="tool_choice")
        return ToolChoice("function", name)
    if isinstance(choice, dict) and choice.get("type") == "mcp" and not nested:
        server, name = choice.get("server_label"), choice.get("name")
        if not isinstance(server, str) or not server:
            raise InvalidRequest(
                "tool_choice of type mcp needs a server_label", param="tool_choice"
            )
        if not isinstance(name, str) or not name:
            raise InvalidRequest(
                "tool_choice of type mcp must name the tool (Barrel forces one tool)",
                param="tool_choice",
            )
        return ToolChoice("function", name, server)
    raise InvalidRequest(
        "tool_choice must be auto, none, required, a function"
        + ("" if nested else " or an mcp tool"),
        param="tool_choice",
    )


def decode(raw: bytes, conversation: str | None = None) -> tuple[ApiRequest, ChatCompletionBody]:
    """Everything that can be checked without the model, before queueing or loading; and
    the body, for the encoder. `conversation` is the session header (x-conversation-id, x-session-id
    or x-smg-routing-key), if sent."""
    body = decode_json(raw, ChatCompletionBody)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    check_knobs(body)
    if not body.messages:
        raise InvalidRequest("messages must hold at least one message", param="messages")
    if body.max_tokens == 0:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if body.reasoning_effort is not None and body.reasoning_effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}", param="reasoning_effort"
        )
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    tools = to_tools(body.tools)
    return ApiRequest(
        model=body.model,
        dialect=Dialect.OPENAI,
        messages=to_messages(body.messages),
        tools=tools,
        tool_choice=tool_choice_of(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        servers=barrel_servers(body.mcp_servers),
        format=format_of(body),
        options=options_of(body),
        logit_bias=logit_bias_of(body),
        ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        max_tokens=body.max_tokens,
        n=body.n,
        stream=body.stream,
        reasoning_effort=body.reasoning_effort,
        template_kwargs=body.chat_template_kwargs or {},
        generation_prompt=body.add_generation_prompt is not False,
        continue_final=body.continue_final_message,
        conversation=conversation or body.prompt_cache_key,
        lora=lora_of(body),
    ), body


# -- response ----------------------------------------------------------------------------


def tool_call(event: ToolCallEvent, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": event.id if event.id.startswith("call_") else f"call_{event.id}",
        "type": "function",
        "function": {"name": event.name, "arguments": event.arguments},
    }
    return call if index is None else {"index": index, **call}


def _logprobs(lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {"content": token_logprobs(lps), "refusal": None}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None
    # tool-server calls Barrel ran, with their results (Barrel's `server_tool_calls`)
    server_calls: dict[str, ServerCall] = field(default_factory=dict)
    server_records: list[dict[str, Any]] = field(default_factory=list)


class ChatEncoder:
    def __init__(self, req: ApiRequest, stamp: Stamp = STAMP, usage: bool = False) -> None:
        self.req = req
        self.with_usage = usage
        self.logprobs = req.logprobs is not None
        self.choices = [_Choice() for _ in range(req.n)]
        self.head = {
            "id": stamp.ids("chatcmpl-"),
            "object": "chat.completion.chunk",
            "created": int(stamp.now()),
            "model": req.model,
            "system_fingerprint": FINGERPRINT,
        }
        self.opened = False

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return list(progress(position, loading_s))

    def begin(self, begin: Begin) -> list[Frame]:
        return []  # the role chunk goes with the first event: nothing in its way

    def _chunk(self, index: int, delta: dict[str, Any], **extra: Any) -> Data:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        frame = {**self.head, "choices": [choice]}
        if self.with_usage:
            frame["usage"] = None
        return Data(frame)

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        out: list[Frame] = []
        if not self.opened:
            self.opened = True
            out += [self._chunk(k, {"role": "assistant", "content": ""}) for k in range(self.req.n)]
        c = self.choices[index]
        if isinstance(event, TextDelta):
            c.text.append(event.text)
            c.logprobs.extend(event.logprobs)
            if event.text or event.logprobs:
                lps = _logprobs(event.logprobs) if self.logprobs and event.logprobs else None
                out.append(self._chunk(index, {"content": event.text}, logprobs=lps))
        elif isinstance(event, ReasoningDelta):
            c.reasoning.append(event.text)
            if event.text:
                out.append(self._chunk(index, {"reasoning_content": event.text}))
        elif isinstance(event, ToolCallStart):  # then its arguments, as they are written
            call = tool_call(ToolCallEvent(event.id, event.name, ""), len(c.calls))
            out.append(self._chunk(index, {"tool_calls": [call]}))
        elif isinstance(event, ToolArgsDelta):
            piece = {"index": len(c.calls), "function": {"arguments": event.text}}
            out.append(self._chunk(index, {"tool_calls": [piece]}))
        elif isinstance(event, ToolCallEvent):
            if not event.streamed:
                out.append(self._chunk(index, {"tool_calls": [tool_call(event, len(c.calls))]}))
            c.calls.append(tool_call(event))
        elif isinstance(event, ServerCall):
            c.server_calls[event.id] = event
        elif isinstance(event, ServerResult) and event.id in c.server_calls:
            record = call_record(c.server_calls[event.id], event)
            c.server_records.append(record)
            out.append(self._chunk(index, {"server_tool_calls": [record]}))
        elif isinstance(event, Finished):
            c.finished = event
            c.logprobs.extend(event.logprobs)
            lps = _logprobs(event.logprobs) if self.logprobs and event.logprobs else None
            out.append(self._chunk(index, {}, finish_reason=finish_reason(event), logprobs=lps))
        return out

    def _usages(self) -> list[Usage]:
        out = [c.finished.usage for c in self.choices if c.finished is not None]
        if len(out) != len(self.choices):
            raise BarrelError("the generation ended without a result")
        return out

    def end(self) -> list[Frame]:
        usages = self._usages()
        out: list[Frame] = []
        if self.with_usage:
            out.append(Data({**self.head, "choices": [], "usage": usage_of(usages)}))
        return [*out, DONE]

    def full(self) -> dict[str, Any]:
        usages = self._usages()
        out: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": []}
        for i, c in enumerate(self.choices):
            assert c.finished is not None
            text = "".join(c.text)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if text or not c.calls else None,
                "refusal": None,
            }
            if c.reasoning:
                message["reasoning_content"] = "".join(c.reasoning)
            if c.calls:
                message["tool_calls"] = c.calls
            if c.server_records:
                message["server_tool_calls"] = c.server_records
            out["choices"].append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": _logprobs(c.logprobs) if self.logprobs else None,
                    "finish_reason": finish_reason(c.finished),
                }
            )
        out["usage"] = usage_of(usages)
        return out

    def error(self, err: BarrelError) -> list[Frame]:
        return [error_frame(err)]


def encoder(req: ApiRequest, body: ChatCompletionBody, stamp: Stamp = STAMP) -> ChatEncoder:
    return ChatEncoder(req, stamp, usage=include_usage(body))
