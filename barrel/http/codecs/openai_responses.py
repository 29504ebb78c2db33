"""OpenAI's Responses API as a codec.

Input (a string or items: messages, function calls and their outputs) and `instructions`
decode into the neutral request, after the conversation of `previous_response_id` (looked
up through the function the handler passes). Events become output items (reasoning,
message, function_call), or the named events of a stream (response.created ...
response.output_text.delta ... response.completed), each with its sequence number.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import STAMP, Begin, Data, Frame, Stamp, constraints
from barrel.http.codecs.openai_chat import (
    EFFORTS,
    arguments_of,
    parts_of,
    text_of,
    tool_choice_of,
)
from barrel.http.codecs.openai_common import (
    Knobs,
    check_knobs,
    decode_json,
    format_of,
    logit_bias_of,
    options_of,
    progress,
)
from barrel.http.codecs.servers import responses_server, server_round
from barrel.pipeline.events import (
    ChatEvent,
    Finished,
    ReasoningDelta,
    ServerCall,
    ServerResult,
    ServerTools,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.request import (
    ApiRequest,
    Dialect,
    Format,
    Message,
    ServerUse,
    TextPart,
    Tool,
    ToolCall,
    text,
)


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


History = Callable[[str], tuple[Message, ...] | None]

# -- request -----------------------------------------------------------------------------


def _items(raw: Any) -> list[Message]:
    """Input items -> neutral messages; function calls join the assistant turn they
    belong to."""
    if isinstance(raw, str):
        return [text("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a list of items", param="input")
    out: list[Message] = []
    calls: list[tuple[ToolCall, str]] = []  # a round of server calls, with their results
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind != "mcp_call" and calls:
            out += server_round(calls)
            calls = []
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    "role must be user, system, developer or assistant", param=f"{param}.role"
                )
            where = f"{param}.content"
            if role == "user":
                out.append(Message(role="user", parts=parts_of(item.get("content"), where)))
            else:
                said = text_of(item.get("content"), where)
                out.append(text("system" if role == "developer" else role, said))
        elif kind == "function_call":
            if not item.get("name"):
                raise InvalidRequest("a function_call item needs a name", param=param)
            arguments = arguments_of(item.get("arguments") or "{}", f"{param}.arguments")
            call = ToolCall(str(item.get("call_id", "")), str(item["name"]), arguments)
            last = out[-1] if out else None
            if last is None or last.role != "assistant" or last.text:
                out.append(Message(role="assistant", tool_calls=(call,)))
            else:
                out[-1] = msgspec.structs.replace(last, tool_calls=(*last.tool_calls, call))
        elif kind == "function_call_output":
            output = item.get("output", "")
            said = output if isinstance(output, str) else text_of(output, f"{param}.output")
            out.append(
                Message(
                    role="tool",
                    parts=(TextPart(said),) if said else (),
                    tool_call_id=str(item.get("call_id", "")),
                )
            )
        elif kind == "mcp_call":  # a server tool's call and its result, sent back
            calls.append(_mcp_call(item, param))
            continue
        elif kind in ("reasoning", "mcp_list_tools"):
            continue  # earlier thoughts, a server's tool list: not part of the prompt
        else:
            raise InvalidRequest(f"input items of type {kind!r} are not supported", param=param)
    return out + server_round(calls)


def _mcp_call(item: dict[str, Any], param: str) -> tuple[ToolCall, str]:
    if not isinstance(item.get("name"), str) or not item["name"]:
        raise InvalidRequest("an mcp_call item needs a name", param=param)
    arguments = arguments_of(item.get("arguments") or "{}", f"{param}.arguments")
    output = item.get("output")
    error = item.get("error")
    if not isinstance(output, str):
        output = json.dumps(error) if error is not None else ""
    return ToolCall(str(item.get("id", "")), item["name"], arguments), output


def _tools(tools: list[dict[str, Any]]) -> tuple[tuple[Tool, ...], tuple[ServerUse, ...]]:
    """Function tools, and the configured tool servers `mcp` tools name."""
    out = []
    servers: list[ServerUse] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest("each tool must be an object", param=f"tools[{i}]")
        if tool.get("type") == "mcp":
            servers.append(responses_server(tool, i))
            continue
        if tool.get("type") != "function" or not tool.get("name"):
            raise InvalidRequest(
                f"only function tools are supported, not {tool.get('type')!r}",
                param=f"tools[{i}]",
            )
        params = tool.get("parameters") or {"type": "object"}
        out.append(Tool(str(tool["name"]), str(tool.get("description") or ""), params))
    if len({u.name for u in servers}) != len(servers):
        raise InvalidRequest("a tool server is named twice", param="tools")
    return tuple(out), tuple(servers)


def _format(text_field: dict[str, Any] | None) -> Format:
    fmt = (text_field or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return Format()
    if fmt.get("type") == "json_object":
        return Format("json_object")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be an object", param="text.format")
        return Format("json_schema", fmt["schema"])
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


def decode(
    raw: bytes, history: History, conversation: str | None = None
) -> tuple[ApiRequest, ResponsesBody]:
    """The whole conversation (the stored one first, when continued) as a neutral
    request, checked before any queueing; and the body, for the encoder."""
    body = decode_json(raw, ResponsesBody)
    body.max_tokens = body.max_output_tokens
    check_knobs(body)
    if body.max_tokens == 0:
        raise InvalidRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    earlier: tuple[Message, ...] = ()
    if body.previous_response_id is not None:
        found = history(body.previous_response_id)
        if found is None:
            raise PreviousResponseNotFound(
                f"Previous response with id {body.previous_response_id!r} not found "
                "(responses are kept for a while, unless sent with store: false).",
                param="previous_response_id",
            )
        earlier = found
    messages = [*earlier, *_items(body.input)]
    if body.instructions:  # instructions are not carried over from the previous response
        messages = [m for m in messages if m.role != "system"]
        messages.insert(0, text("system", body.instructions))
    tools, servers = _tools(body.tools)
    return ApiRequest(
        model=body.model,
        dialect=Dialect.OPENAI,
        messages=tuple(messages),
        tools=tools,
        servers=servers,
        tool_choice=tool_choice_of(body.tool_choice, nested=False),
        parallel_tool_calls=body.parallel_tool_calls,
        format=constraints.one_of(
            **{"text.format": _format(body.text), "json_schema or grammar": format_of(body)}
        ),
        options=options_of(body),
        logit_bias=logit_bias_of(body),
        ignore_eos=body.ignore_eos,
        max_tokens=body.max_tokens,
        stream=body.stream,
        reasoning_effort=_effort(body),
        conversation=conversation or body.prompt_cache_key,
    ), body


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


class ResponsesEncoder:
    """The response object and its output items, built as events come, and the named
    events of a stream."""

    def __init__(self, req: ApiRequest, body: ResponsesBody, stamp: Stamp = STAMP) -> None:
        self.req = req
        self.stamp = stamp
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[str, dict[str, Any]] = {}  # server calls running, by call id
        self.finished = False
        self.response: dict[str, Any] = {
            "id": stamp.ids("resp_"),
            "object": "response",
            "created_at": int(stamp.now()),
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

    def _event(self, kind: str, **fields: Any) -> Data:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return Data(event, kind)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return list(progress(position, loading_s))

    def begin(self, begin: Begin) -> list[Frame]:
        snapshot = dict(self.response, output=[])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=dict(snapshot)),
        ]

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Frame]:
        out = self._close()
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if "content" in item:
            added["content"] = []
        out.append(
            self._event("response.output_item.added", output_index=len(self.items) - 1, item=added)
        )
        if part is not None:
            item["content"].append(part)
            out.append(
                self._event(
                    "response.content_part.added",
                    **self._where(item),
                    content_index=0,
                    part=dict(part),
                )
            )
        return out

    def _close(self) -> list[Frame]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = self._where(item)
        out: list[Frame] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                done = self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            else:
                done = self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=part["text"]
                )
            out.append(done)
            out.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        out.append(
            self._event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return out

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        out: list[Frame] = []
        if isinstance(event, ReasoningDelta) and event.text:
            if self.open is None or self.open["type"] != "reasoning":
                item = {
                    "type": "reasoning",
                    "id": self.stamp.ids("rs_"),
                    "summary": [],
                    "content": [],
                }
                out += self._open(item, {"type": "reasoning_text", "text": ""})
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            out.append(
                self._event(
                    "response.reasoning_text.delta",
                    **self._where(self.open),
                    content_index=0,
                    delta=event.text,
                )
            )
        elif isinstance(event, TextDelta) and event.text:
            if self.open is None or self.open["type"] != "message":
                item = {
                    "type": "message",
                    "id": self.stamp.ids("msg_"),
                    "status": "completed",
                    "role": "assistant",
                    "content": [],
                }
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += self._open(item, part)
            assert self.open is not None
            self.open["content"][0]["text"] += event.text
            out.append(
                self._event(
                    "response.output_text.delta",
                    **self._where(self.open),
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            )
        elif isinstance(event, ToolCallStart):  # its arguments follow as written
            out += self._open(self._call_item(event.id, event.name), None)
        elif isinstance(event, ToolArgsDelta) and event.text and self._calling():
            assert self.open is not None
            self.open["arguments"] += event.text
            where = self._where(self.open)
            out.append(
                self._event("response.function_call_arguments.delta", **where, delta=event.text)
            )
        elif isinstance(event, ToolCallEvent):
            if not (event.streamed and self._calling()):
                out += self._open(self._call_item(event.id, event.name), None)
                assert self.open is not None
                self.open["arguments"] = event.arguments
                where = self._where(self.open)
                delta = event.arguments
                out.append(
                    self._event("response.function_call_arguments.delta", **where, delta=delta)
                )
            call = self.open
            assert call is not None
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(call),
                    name=event.name,
                    arguments=call["arguments"],
                )
            )
            out += self._close()
        elif isinstance(event, ServerTools | ServerCall | ServerResult):
            out += self._server(event)
        elif isinstance(event, Finished):
            out += self._finish(event)
        return out

    def _server(self, event: ServerTools | ServerCall | ServerResult) -> list[Frame]:
        """A server's tool list, a server call as it starts and as it ends: items of
        their own (`mcp_list_tools`, `mcp_call`), with the events OpenAI streams."""
        out = self._close()
        if isinstance(event, ServerTools):
            item: dict[str, Any] = {
                "type": "mcp_list_tools",
                "id": self.stamp.ids("mcpl_"),
                "server_label": event.server,
                "tools": [
                    {
                        "name": t.name,
                        "description": t.description,
                        "input_schema": t.parameters,
                        "annotations": None,
                    }
                    for t in event.tools
                ],
                "error": None,
            }
            self.items.append(item)
            where = self._where(item)
            added = {**item, "tools": []}
            out.append(
                self._event(
                    "response.output_item.added", output_index=where["output_index"], item=added
                )
            )
            out.append(self._event("response.mcp_list_tools.in_progress", **where))
            out.append(self._event("response.mcp_list_tools.completed", **where))
            out.append(
                self._event(
                    "response.output_item.done", output_index=where["output_index"], item=item
                )
            )
        elif isinstance(event, ServerCall):
            item = {
                "type": "mcp_call",
                "id": self.stamp.ids("mcp_"),
                "server_label": event.server,
                "name": event.name,
                "arguments": event.arguments,
                "output": None,
                "error": None,
                "status": "in_progress",
                "approval_request_id": None,
            }
            self.items.append(item)
            self.calls[event.id] = item
            where = self._where(item)
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=where["output_index"],
                    item=dict(item),
                )
            )
            out.append(
                self._event("response.mcp_call_arguments.delta", **where, delta=event.arguments)
            )
            out.append(
                self._event("response.mcp_call_arguments.done", **where, arguments=event.arguments)
            )
            out.append(self._event("response.mcp_call.in_progress", **where))
        elif event.id in self.calls:
            item = self.calls.pop(event.id)
            where = self._where(item)
            if event.result.error:
                item["status"] = "failed"
                item["error"] = {
                    "type": "mcp_tool_execution_error",
                    "content": [{"type": "text", "text": event.result.output}],
                }
                out.append(self._event("response.mcp_call.failed", **where))
            else:
                item["status"] = "completed"
                item["output"] = event.result.output
                out.append(self._event("response.mcp_call.completed", **where))
            out.append(
                self._event(
                    "response.output_item.done", output_index=where["output_index"], item=item
                )
            )
        return out

    def _call_item(self, cid: str, name: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": self.stamp.ids("fc_"),
            "call_id": cid if cid.startswith("call_") else f"call_{cid}",
            "name": name,
            "arguments": "",
            "status": "completed",
        }

    def _calling(self) -> bool:
        """A function call's item is open: its arguments are streaming."""
        return self.open is not None and self.open["type"] == "function_call"

    def _finish(self, fin: Finished) -> list[Frame]:
        out = self._close()
        self.finished = True
        r = self.response
        r["usage"] = _usage(fin)
        r["completed_at"] = int(self.stamp.now())
        if fin.reason in ("length", "context"):
            # a full context window in OpenAI's word for it (its error code)
            why = "max_output_tokens" if fin.reason == "length" else "context_length_exceeded"
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": why}
            out.append(self._event("response.incomplete", response=r))
        else:
            r["status"] = "completed"
            out.append(self._event("response.completed", response=r))
        return out

    def end(self) -> list[Frame]:
        if not self.finished:
            raise BarrelError("the generation ended without a result")
        return []

    def full(self) -> dict[str, Any]:
        return self.response

    def error(self, err: BarrelError) -> list[Frame]:
        return [self._event("error", code=err.code, message=err.message, param=err.param)]

    def as_messages(self) -> tuple[Message, ...]:
        """The output as the assistant's turn, for the next response to continue: each
        round of server calls (the text before it, its calls, their results), then the
        last text and the client's calls."""
        out: list[Message] = []
        said = ""
        calls: list[ToolCall] = []
        server: list[tuple[ToolCall, str]] = []
        for item in self.items:
            if item["type"] == "mcp_call":
                args = json.loads(item["arguments"] or "{}")
                output = item["output"] if item["output"] is not None else _error_text(item)
                server.append((ToolCall(item["id"], item["name"], args), output))
                continue
            if server:
                first, *rest = server_round(server)
                parts = (TextPart(said),) if said else ()
                out += [msgspec.structs.replace(first, parts=parts), *rest]
                said, server = "", []
            if item["type"] == "message":
                said += item["content"][0]["text"]
            elif item["type"] == "function_call":
                args = json.loads(item["arguments"])
                calls.append(ToolCall(item["call_id"], item["name"], args))
        if server:
            first, *rest = server_round(server)
            out += [msgspec.structs.replace(first, parts=(TextPart(said),) if said else ()), *rest]
            said = ""
        if said or calls or not out:
            out.append(
                Message(
                    role="assistant",
                    parts=(TextPart(said),) if said else (),
                    tool_calls=tuple(calls),
                )
            )
        return tuple(out)


def _error_text(item: dict[str, Any]) -> str:
    error = item.get("error") or {}
    parts = error.get("content") if isinstance(error, dict) else None
    if isinstance(parts, list):
        return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
    return json.dumps(error)
