"""OpenAI's POST /v1/chat/completions.

Requests decode into the chat pipeline's `ChatRequest`; its events encode as a
`chat.completion`, or as `chat.completion.chunk` frames ending with `data: [DONE]`.
Reasoning comes back as `reasoning_content` (as llama-server and DeepSeek send it), tool
calls as whole calls (one delta with the complete arguments), `n > 1` as parallel engine
sequences, and `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens taken
from the KV cache. While the request waits in the queue or for a load, a stream carries
SSE comments.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from aiohttp import web

from barrel import __version__
from barrel.actors.lifecycle import Lease
from barrel.engine.types import TokenLogprob, Usage
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.keys import METRICS
from barrel.http.leases import check_limits, prepare_on, template_of, with_model_messages
from barrel.http.openai_common import (
    MAX_TOP_LOGPROBS,
    Knobs,
    check_knobs,
    decode,
    include_usage,
    leased,
    merged,
    new_id,
    sampling_for,
    stream_failed,
    token_logprobs,
    usage_of,
)
from barrel.http.sse import SseWriter
from barrel.pipeline.chat import (
    ChatEvent,
    ChatRequest,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallEvent,
    run,
)
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import ChatTemplate

routes = web.RouteTableDef()

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# reasoning tokens allowed before the thinking block is closed for the model
EFFORT_BUDGETS = {"minimal": 64, "low": 256, "medium": 512, "high": 1024, "xhigh": 2048}
FINGERPRINT = f"barrel-{__version__}"


class ChatBody(Knobs, kw_only=True):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- request -----------------------------------------------------------------------------


def text_of(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (images and audio are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or a list of parts", param=param)
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text", "refusal"):
            out.append(str(part.get("text", part.get("refusal", ""))))
        elif kind in ("image_url", "input_image", "input_audio", "file", "input_file"):
            raise InvalidRequest(
                f"this model reads text only; {kind} parts are not supported",
                param=f"{param}[{i}]",
            )
        else:
            raise InvalidRequest(f"unknown content part type {kind!r}", param=f"{param}[{i}]")
    return "".join(out)


def _arguments(raw: Any, param: str) -> Any:
    """Tool-call arguments come as a JSON string; the pipeline wants the object."""
    if not isinstance(raw, str):
        return raw if raw is not None else {}
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise InvalidRequest(f"{param} must be a JSON object string", param=param) from None


def _calls(raw: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise InvalidRequest(f"{param} must be a list", param=param)
    out = []
    for i, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            raise InvalidRequest("a tool call needs function.name", param=f"{param}[{i}]")
        out.append(
            {
                "id": str(call.get("id", f"call_{i}")),
                "type": "function",
                "function": {
                    "name": str(fn["name"]),
                    "arguments": _arguments(
                        fn.get("arguments"), f"{param}[{i}].function.arguments"
                    ),
                },
            }
        )
    return out


def to_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's messages -> the pipeline's (developer becomes system, parts become text)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if role in ("system", "developer"):
            out.append({"role": "system", "content": text_of(content, f"{param}.content")})
        elif role == "user":
            out.append({"role": "user", "content": text_of(content, f"{param}.content")})
        elif role == "assistant":
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": text_of(content, f"{param}.content"),
            }
            if m.get("tool_calls"):
                msg["tool_calls"] = _calls(m["tool_calls"], f"{param}.tool_calls")
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
            out.append(msg)
        elif role in ("tool", "function"):
            msg = {"role": "tool", "content": text_of(content, f"{param}.content")}
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
            if m.get("name"):
                msg["name"] = str(m["name"])
            out.append(msg)
        else:
            raise InvalidRequest(
                "role must be system, developer, user, assistant or tool", param=f"{param}.role"
            )
    return out


def check_tools(tools: list[dict[str, Any]], choice: Any) -> str | dict[str, Any]:
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest("only function tools are supported", param=f"tools[{i}]")
        if not fn.get("name"):
            raise InvalidRequest("a function tool needs a name", param=f"tools[{i}].function")
        names.append(fn["name"])
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return choice
    raise InvalidRequest(
        "tool_choice must be auto, none, required or a function", param="tool_choice"
    )


def _check_format(fmt: dict[str, Any] | None) -> None:
    if fmt is None:
        return
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            "response_format.type must be text, json_object or json_schema",
            param="response_format",
        )
    if kind == "json_schema" and not isinstance(
        (fmt.get("json_schema") or {}).get("schema", {}), dict
    ):
        raise InvalidRequest(
            "response_format.json_schema.schema must be an object", param="response_format"
        )


def chat_request(body: ChatBody) -> ChatRequest:
    """Everything that can be checked without the model, before queueing or loading."""
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
    _check_format(body.response_format)
    return ChatRequest(
        to_messages(body.messages),
        tools=body.tools,
        tool_choice=check_tools(body.tools, body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format,
    )


def thinking_of(
    effort: str | None, kwargs: dict[str, Any], template: ChatTemplate
) -> tuple[bool | None, dict[str, Any]]:
    """reasoning_effort: "none" turns thinking off; another effort turns it on for a
    template that knows <think> blocks, sets the reasoning budget (EFFORT_BUDGETS) and
    reaches the template as `reasoning_effort`. An explicit
    chat_template_kwargs.enable_thinking wins."""
    kwargs = dict(kwargs)
    if effort and effort != "none":
        kwargs.setdefault("reasoning_effort", effort)
    if isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"], kwargs
    if effort == "none":
        return False, kwargs
    if effort is not None and "<think>" in template.source:
        return True, kwargs
    return None, kwargs


def for_model(
    req: ChatRequest, body: ChatBody, lease: Lease, template: ChatTemplate, request: web.Request
) -> ChatRequest:
    req = dataclasses.replace(req)
    req.messages, _ = with_model_messages(lease, req.messages)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req.sampling, req.max_tokens, req.stop = sampling_for(body, lease, logprobs)
    req.thinking, req.template_kwargs = thinking_of(
        body.reasoning_effort, body.chat_template_kwargs or {}, template
    )
    req.reasoning_budget = EFFORT_BUDGETS.get(body.reasoning_effort or "", req.reasoning_budget)
    conversation = request.headers.get("x-conversation-id") or body.prompt_cache_key
    req.session = derive_session(lease.spec.name, req.messages, conversation)
    return req


# -- response ----------------------------------------------------------------------------


def _finish(fin: Finished) -> str:
    return "stop" if fin.reason == "cancelled" else fin.reason


def _tool_call(event: ToolCallEvent, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": event.id if event.id.startswith("call_") else f"call_{event.id}",
        "type": "function",
        "function": {"name": event.name, "arguments": event.arguments},
    }
    return call if index is None else {"index": index, **call}


def _logprobs(lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {"content": token_logprobs(lps), "refusal": None}


@dataclasses.dataclass
class _Choice:
    text: list[str] = dataclasses.field(default_factory=list)
    reasoning: list[str] = dataclasses.field(default_factory=list)
    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finished: Finished | None = None


def _head(kind: str, model: str) -> dict[str, Any]:
    return {
        "id": new_id("chatcmpl-"),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
    }


def _usages(finished: list[Finished | None]) -> list[Usage]:
    out = [f.usage for f in finished if f is not None]
    if len(out) != len(finished):
        raise BarrelError("the generation ended without a result")
    return out


async def _collect(
    runs: list[AsyncGenerator[ChatEvent, None]], model: str, logprobs: bool
) -> dict[str, Any]:
    choices = [_Choice() for _ in runs]
    async for i, event in merged(runs):
        c = choices[i]
        if isinstance(event, TextDelta):
            c.text.append(event.text)
            c.logprobs.extend(event.logprobs)
        elif isinstance(event, ReasoningDelta):
            c.reasoning.append(event.text)
        elif isinstance(event, ToolCallEvent):
            c.calls.append(_tool_call(event))
        elif isinstance(event, Finished):
            c.finished = event
            c.logprobs.extend(event.logprobs)
    usages = _usages([c.finished for c in choices])
    out = _head("chat.completion", model)
    out["choices"] = []
    for i, c in enumerate(choices):
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
        out["choices"].append(
            {
                "index": i,
                "message": message,
                "logprobs": _logprobs(c.logprobs) if logprobs else None,
                "finish_reason": _finish(c.finished),
            }
        )
    out["usage"] = usage_of(usages)
    return out


async def _stream(
    sse: SseWriter,
    runs: list[AsyncGenerator[ChatEvent, None]],
    body: ChatBody,
) -> None:
    head = _head("chat.completion.chunk", body.model)
    with_usage = include_usage(body)

    async def send(index: int, delta: dict[str, Any], **extra: Any) -> None:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        frame = {**head, "choices": [choice]}
        if with_usage:
            frame["usage"] = None
        await sse.send(frame)

    calls = [0] * len(runs)
    finished: list[Finished | None] = [None] * len(runs)
    opened = False
    async for i, event in merged(runs):
        if not opened:  # after the engine has the request: nothing in its way
            opened = True
            for k in range(len(runs)):
                await send(k, {"role": "assistant", "content": ""})
        if isinstance(event, TextDelta) and (event.text or event.logprobs):
            lps = _logprobs(event.logprobs) if body.logprobs and event.logprobs else None
            await send(i, {"content": event.text}, logprobs=lps)
        elif isinstance(event, ReasoningDelta) and event.text:
            await send(i, {"reasoning_content": event.text})
        elif isinstance(event, ToolCallEvent):
            await send(i, {"tool_calls": [_tool_call(event, calls[i])]})
            calls[i] += 1
        elif isinstance(event, Finished):
            finished[i] = event
            lps = _logprobs(event.logprobs) if body.logprobs and event.logprobs else None
            await send(i, {}, finish_reason=_finish(event), logprobs=lps)
    usages = _usages(finished)
    if with_usage:
        await sse.send({**head, "choices": [], "usage": usage_of(usages)})
    await sse.done()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await decode(request, ChatBody)
    check_limits(request, body.messages, body.tools)
    base = chat_request(body)
    sse = SseWriter(request) if body.stream else None
    timings = request.app[METRICS].pipeline_timings
    try:
        async with leased(request, body.model, sse) as lease:
            template = await template_of(request, lease)
            req = for_model(base, body, lease, template, request)
            prep = await prepare_on(lease, req, template)
            # the first choice continues the conversation's session; the others are new
            reqs = [req] + [dataclasses.replace(req, session=None)] * (body.n - 1)
            runs = [run(lease.engine, r, prep, timings) for r in reqs]
            if sse is None:
                return web.json_response(await _collect(runs, body.model, body.logprobs))
            await _stream(sse, runs, body)
    except ConnectionError:
        raise  # the client went away: nobody to tell
    except Exception as err:  # noqa: BLE001 - a stream that began ends with an error frame
        return await stream_failed(sse, err)
    assert sse is not None
    return await sse.close()
