"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

Input (a string or items: messages, function calls and their outputs) and `instructions`
decode into the chat pipeline's `ChatRequest`; its events become output items (reasoning,
message, function_call), or the named events of a stream (response.created ...
response.output_text.delta ... response.completed). Responses are kept in memory for
`[responses] store_ttl_s` unless `store` is false, so `previous_response_id` can continue
one; an unknown or expired id is a 400 that says so.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from aiohttp import web

from barrel.actors.lifecycle import Lease
from barrel.errors import BarrelError, InvalidRequest, NotFound
from barrel.http.keys import METRICS
from barrel.http.leases import check_limits, prepare_on, template_of, with_model_messages
from barrel.http.openai_chat import EFFORT_BUDGETS, EFFORTS, text_of, thinking_of
from barrel.http.openai_common import (
    Knobs,
    check_knobs,
    decode,
    leased,
    merged,
    new_id,
    sampling_for,
)
from barrel.http.response_store import ResponseStore
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

STORE = web.AppKey("response_store", ResponseStore)


def store_of(request: web.Request) -> ResponseStore:
    return request.app[STORE]


class PreviousResponseNotFound(InvalidRequest):
    code = "previous_response_not_found"


class ResponsesBody(Knobs, kw_only=True):
    input: Any = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    top_logprobs: int | None = None


# -- request -----------------------------------------------------------------------------


def _items(raw: Any) -> list[dict[str, Any]]:
    """Input items -> the pipeline's messages; function calls join the assistant turn
    they belong to."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    "role must be user, system, developer or assistant", param=f"{param}.role"
                )
            content = text_of(item.get("content"), f"{param}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not item.get("name"):
                raise InvalidRequest("a function_call item needs a name", param=param)
            try:
                arguments = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                raise InvalidRequest(
                    "arguments must be a JSON object string", param=f"{param}.arguments"
                ) from None
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": str(item["name"]), "arguments": arguments},
            }
            if not out or out[-1]["role"] != "assistant" or out[-1].get("content"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else text_of(output, f"{param}.output")
            out.append(
                {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": text}
            )
        elif kind == "reasoning":
            continue  # the model's earlier thoughts: templates drop them from history
        else:
            raise InvalidRequest(f"input items of type {kind!r} are not supported", param=param)
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not tool.get("name"):
            raise InvalidRequest(
                f"only function tools are supported, not {tool.get('type')!r}",
                param=f"tools[{i}]",
            )
        fn = {
            "name": tool["name"],
            "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object"},
        }
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in [t["function"]["name"] for t in tools]:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequest(
        "tool_choice must be auto, none, required or a function", param="tool_choice"
    )


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be an object", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), **fmt}}
    raise InvalidRequest(
        "text.format.type must be text, json_object or json_schema", param="text.format"
    )


def _effort(body: ResponsesBody) -> str | None:
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort"
        )
    return effort


def chat_request(request: web.Request, body: ResponsesBody) -> tuple[ChatRequest, int]:
    """The whole conversation (the stored one first, when continued) as a ChatRequest,
    checked before any queueing; and where the new turn starts."""
    body.max_tokens = body.max_output_tokens
    check_knobs(body)
    if body.max_tokens == 0:
        raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store_of(request).get(body.previous_response_id)
        if stored is None:
            raise PreviousResponseNotFound(
                f"Previous response with id {body.previous_response_id!r} not found "
                "(responses are kept for a while, unless sent with store: false).",
                param="previous_response_id",
            )
        history = list(stored.messages)
    messages = [*history, *_items(body.input)]
    if body.instructions:  # instructions are not carried over from the previous response
        messages = [m for m in messages if m["role"] != "system"]
        messages.insert(0, {"role": "system", "content": body.instructions})
    tools = _tools(body.tools)
    check_limits(request, messages, tools)
    _effort(body)
    req = ChatRequest(
        messages,
        tools=tools,
        tool_choice=_tool_choice(body.tool_choice, tools),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_format(body.text),
    )
    return req, len(messages)


def for_model(
    req: ChatRequest,
    body: ResponsesBody,
    lease: Lease,
    template: ChatTemplate,
    request: web.Request,
) -> ChatRequest:
    req = dataclasses.replace(req)
    req.messages, _ = with_model_messages(lease, req.messages)
    req.sampling, req.max_tokens, req.stop = sampling_for(body, lease, None)
    effort = _effort(body)
    req.thinking, req.template_kwargs = thinking_of(effort, {}, template)
    req.reasoning_budget = EFFORT_BUDGETS.get(effort or "", req.reasoning_budget)
    conversation = request.headers.get("x-conversation-id") or body.prompt_cache_key
    req.session = derive_session(lease.spec.name, req.messages, conversation)
    return req


# -- response ----------------------------------------------------------------------------


def _usage(fin: Finished) -> dict[str, Any]:
    u = fin.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_reused, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class _Output:
    """The response object and its output items, built as events come; `emit` hears
    each streaming event (or nothing, without streaming)."""

    def __init__(self, body: ResponsesBody, emit: Any) -> None:
        self.emit = emit
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.response: dict[str, Any] = {
            "id": new_id("resp_"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": body.model,
            "output": self.items,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "text": body.text or {"format": {"type": "text"}},
            "store": body.store,
            "usage": None,
        }

    async def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.emit(kind, event)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    async def start(self) -> None:
        await self.send("response.created", response=dict(self.response, output=[]))
        await self.send("response.in_progress", response=dict(self.response, output=[]))

    async def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        await self.close()
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if "content" in item:
            added["content"] = []
        await self.send("response.output_item.added", output_index=len(self.items) - 1, item=added)
        if part is not None:
            item["content"].append(part)
            await self.send(
                "response.content_part.added",
                **self._where(item),
                content_index=0,
                part=dict(part),
            )

    async def close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            await self.send(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            await self.send("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            await self.send(
                "response.reasoning_text.done", **where, content_index=0, text=part["text"]
            )
            await self.send("response.content_part.done", **where, content_index=0, part=part)
        await self.send("response.output_item.done", output_index=where["output_index"], item=item)

    async def feed(self, event: ChatEvent) -> None:
        if isinstance(event, ReasoningDelta) and event.text:
            if self.open is None or self.open["type"] != "reasoning":
                item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": []}
                await self._open(item, {"type": "reasoning_text", "text": ""})
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            await self.send(
                "response.reasoning_text.delta",
                **self._where(self.open),
                content_index=0,
                delta=event.text,
            )
        elif isinstance(event, TextDelta) and event.text:
            if self.open is None or self.open["type"] != "message":
                item = {
                    "type": "message",
                    "id": new_id("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                await self._open(item, part)
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            await self.send(
                "response.output_text.delta",
                **self._where(self.open),
                content_index=0,
                delta=event.text,
                logprobs=[],
            )
        elif isinstance(event, ToolCallEvent):
            call_id = event.id if event.id.startswith("call_") else f"call_{event.id}"
            item = {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call_id,
                "name": event.name,
                "arguments": "",
                "status": "completed",
            }
            await self._open(item, None)
            item["arguments"] = event.arguments
            where = self._where(item)
            await self.send(
                "response.function_call_arguments.delta", **where, delta=event.arguments
            )
            await self.send(
                "response.function_call_arguments.done",
                **where,
                name=event.name,
                arguments=event.arguments,
            )
            await self.close()

    async def finish(self, fin: Finished) -> None:
        await self.close()
        r = self.response
        r["usage"] = _usage(fin)
        r["completed_at"] = int(time.time())
        if fin.reason == "length":
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
            await self.send("response.incomplete", response=r)
        else:
            r["status"] = "completed"
            await self.send("response.completed", response=r)

    def as_message(self) -> dict[str, Any]:
        """The output as the pipeline's assistant message, for the next turn."""
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "message":
                msg["content"] += item["content"][0]["text"]
            elif item["type"] == "function_call":
                call = {"name": item["name"], "arguments": json.loads(item["arguments"])}
                msg.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        return msg


async def _respond(out: _Output, events: AsyncGenerator[ChatEvent, None]) -> None:
    await out.start()
    async for _, event in merged([events]):
        if isinstance(event, Finished):
            await out.finish(event)
            return
        await out.feed(event)
    raise BarrelError("the generation ended without a result")


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    body = await decode(request, ResponsesBody)
    base, _ = chat_request(request, body)
    sse = SseWriter(request) if body.stream else None

    async def emit(kind: str, event: dict[str, Any]) -> None:
        if sse is not None:
            await sse.send(event, kind)

    out = _Output(body, emit)
    try:
        async with leased(request, body.model, sse) as lease:
            template = await template_of(request, lease)
            req = for_model(base, body, lease, template, request)
            prep = await prepare_on(lease, req, template)
            await _respond(out, run(lease.engine, req, prep, request.app[METRICS].pipeline_timings))
    except ConnectionError:
        raise
    except Exception as err:
        if sse is None or not sse.started:
            raise
        if not isinstance(err, BarrelError):
            err = BarrelError("internal server error")
        await out.send("error", code=err.code, message=err.message, param=err.param)
        return await sse.close()
    if body.store:
        store_of(request).put(out.response, [*base.messages, out.as_message()])
    if sse is None:
        return web.json_response(out.response)
    return await sse.close()


@routes.get("/v1/responses/{id}")
async def retrieve_response(request: web.Request) -> web.Response:
    stored = store_of(request).get(request.match_info["id"])
    if stored is None:
        raise NotFound(f"no stored response with id {request.match_info['id']!r}")
    return web.json_response(stored.response)


@routes.delete("/v1/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    if not store_of(request).delete(response_id):
        raise NotFound(f"no stored response with id {response_id!r}")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})
