"""Server-side tools: a turn that goes on through the calls of configured tool servers.

    round 1: generate (the servers' tools offered beside the client's)
             -> the model's calls of server tools: run together, results appended
    round 2: the same sequence continues (its KV cells are reused, nothing is prefilled
             again but the calls' results) ... up to `max_rounds`, then
    the end:  text, and the client's own calls, as a turn without server tools ends

Server calls are never streamed as client calls: they become `ServerCall` and
`ServerResult` events (each dialect writes them its way, or not at all). Client calls
are held until the turn ends: a round with both kinds runs the server calls and goes on,
and the client calls it made are returned when the turn finishes (with those of the
last round, a call made twice returned once), so a turn never both continues and
finishes. Identical server calls of one round (tool and arguments) run once, and each
gets the answer. A call that fails, times out or names a tool the server does not offer
is a result the model reads ("error"), never a failed request.

The client's `max_tokens` is the whole turn's: each round gets what the rounds before
left, and a turn that spends it ends as a cut answer ("length") with the server calls
made so far. Results too long for the context end the turn where it stands ("context":
each dialect's own word for a full context window).

The tools and their runner come from the caller (`Toolbox`: barrel.actors.tools builds
it from the configuration, the API key's allow-list and the servers that are up); this
module imports nothing of the actor layer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from barrel.engine.engine import Engine
from barrel.engine.errors import PromptTooLong
from barrel.pipeline import answer
from barrel.pipeline.chat import ChatRequest, Prepared
from barrel.pipeline.events import (
    CallResult,
    ChatEvent,
    Finished,
    ServerCall,
    ServerResult,
    ServerTool,
    ServerTools,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.request import ToolChoice
from barrel.values import Usage


class Toolbox(Protocol):
    """The server tools one request may use, and how to call them."""

    @property
    def tools(self) -> tuple[ServerTool, ...]: ...

    async def call(self, tool: ServerTool, arguments: dict[str, Any]) -> CallResult: ...


Render = Callable[[ChatRequest], Awaitable[Prepared]]


@dataclass
class _Round:
    """What one generation of the turn produced, sorted by who runs the calls."""

    text: str = ""
    server: list[ToolCallEvent] = dataclasses.field(default_factory=list)
    client: list[ChatEvent] = dataclasses.field(default_factory=list)  # held events
    finished: Finished | None = None


async def run(
    engine: Engine,
    chat: ChatRequest,
    prep: Prepared,
    toolbox: Toolbox,
    render: Render,
    max_rounds: int,
    timings: Callable[[float, float], None] | None = None,
) -> AsyncGenerator[ChatEvent, None]:
    """The turn (see the module's docstring): events as `answer.run` yields them, server
    calls and results in between, one `Finished` at the end with the usage of all
    rounds (each round's prompt counts, and the cells it reused: a continuation that
    reuses the turn's cells computes only the calls' results)."""
    by_name = {t.name: t for t in toolbox.tools}
    servers: dict[str, list[ServerTool]] = {}
    for tool in toolbox.tools:
        servers.setdefault(tool.server, []).append(tool)
    for server, tools in servers.items():
        yield ServerTools(server, tuple(tools))
    held: list[ChatEvent] = []
    reused = computed = completion = 0
    prompts = 0
    budget = chat.max_tokens  # the turn's, across its rounds
    for number in range(1, max_rounds + 2):
        turn = _Round()
        try:
            async for event in _generate(engine, chat, prep, by_name, turn, timings):
                yield event
        except PromptTooLong:
            if number == 1:
                raise
            # the results do not fit in the context: the turn ends where it stands
            for event in _released(held, []):
                yield event
            calls = any(isinstance(e, ToolCallEvent) for e in held)
            usage = Usage(prompts, completion, reused, computed)
            yield Finished("tool_calls" if calls else "context", usage)
            return
        done = turn.finished
        assert done is not None
        prompts += done.usage.prompt_tokens
        reused += done.usage.prompt_reused
        computed += done.usage.prompt_computed
        completion += done.usage.completion_tokens
        last = number > max_rounds or done.reason in ("length", "cancelled")
        if not turn.server or last:
            for event in _released(held, turn.client):
                yield event
            calls = any(isinstance(e, ToolCallEvent) for e in (*held, *turn.client))
            usage = Usage(prompts, completion, reused, computed, done.usage.reuse_note)
            reason = done.reason
            if calls and reason != "length":
                reason = "tool_calls"
            elif not calls and reason == "tool_calls":
                reason = "stop"  # the last round's calls were the servers' (max_rounds)
            yield dataclasses.replace(done, reason=reason, usage=usage)
            return
        held.extend(turn.client)
        for call in turn.server:
            yield ServerCall(call.id, by_name[call.name].server, call.name, call.arguments)
        results = await run_once_each(toolbox, by_name, turn.server)
        for call, result in zip(turn.server, results, strict=True):
            tool = by_name[call.name]
            yield ServerResult(call.id, tool.server, call.name, result)
        left = None if budget is None else budget - completion
        if left is not None and left <= 0:
            # the turn's budget is spent: it ends as a cut answer, its calls made
            for event in _released(held, []):
                yield event
            yield Finished("length", Usage(prompts, completion, reused, computed))
            return
        chat = _continued(chat, turn, results, left)
        prep = await render(chat)


async def _generate(
    engine: Engine,
    chat: ChatRequest,
    prep: Prepared,
    by_name: dict[str, ServerTool],
    turn: _Round,
    timings: Callable[[float, float], None] | None,
) -> AsyncGenerator[ChatEvent, None]:
    """One generation: text and reasoning pass through; tool-call events are sorted
    into `turn` (server calls to run, client calls held); `Finished` ends it."""
    current_is_server = False
    async with aclosing(answer.run(engine, chat, prep, timings)) as events:
        async for event in events:
            if isinstance(event, Finished):
                turn.finished = event
            elif isinstance(event, ToolCallStart):
                current_is_server = event.name in by_name
                if not current_is_server:
                    turn.client.append(event)
            elif isinstance(event, ToolArgsDelta):
                if not current_is_server:
                    turn.client.append(event)
            elif isinstance(event, ToolCallEvent):
                if event.name in by_name:
                    turn.server.append(event)
                else:
                    turn.client.append(event)
            else:
                if isinstance(event, TextDelta):
                    turn.text += event.text
                yield event


def _released(held: list[ChatEvent], last: list[ChatEvent]) -> list[ChatEvent]:
    """The client calls of every round, each (name, arguments) once: the held rounds'
    first, then the last round's."""
    seen: set[tuple[str, str]] = set()
    keep: set[str] = set()
    for event in (*held, *last):
        if isinstance(event, ToolCallEvent):
            key = (event.name, _canonical(event.arguments))
            if key not in seen:
                seen.add(key)
                keep.add(event.id)
    out: list[ChatEvent] = []
    current = ""
    for event in (*held, *last):
        if isinstance(event, ToolCallStart | ToolCallEvent):
            current = event.id
        if current in keep:
            out.append(event)
    return out


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def _arguments(call: ToolCallEvent) -> dict[str, Any] | None:
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def run_once_each(
    toolbox: Toolbox, by_name: dict[str, ServerTool], calls: list[ToolCallEvent]
) -> list[CallResult]:
    """The round's calls, at once; identical ones (tool and arguments) run once, and
    each of them gets its answer."""
    keys = [(c.name, _canonical(c.arguments)) for c in calls]
    first: dict[tuple[str, str], ToolCallEvent] = {}
    for key, call in zip(keys, calls, strict=True):
        first.setdefault(key, call)
    done = await asyncio.gather(*(_call(toolbox, by_name, c) for c in first.values()))
    results = dict(zip(first, done, strict=True))
    return [results[key] for key in keys]


async def _call(
    toolbox: Toolbox, by_name: dict[str, ServerTool], call: ToolCallEvent
) -> CallResult:
    arguments = _arguments(call)
    if arguments is None:
        return CallResult("the arguments are not a JSON object", "refused")
    return await toolbox.call(by_name[call.name], arguments)


def _continued(
    chat: ChatRequest, turn: _Round, results: list[CallResult], left: int | None
) -> ChatRequest:
    """The conversation with this round's answer (its text and server calls) and the
    calls' results appended; the next round decides freely again, within the `left`
    tokens of the turn's budget."""
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": _arguments(call) or {}},
        }
        for call in turn.server
    ]
    messages = [
        *chat.messages,
        {"role": "assistant", "content": turn.text, "tool_calls": calls},
        *(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result.output}
            for call, result in zip(turn.server, results, strict=True)
        ),
    ]
    choice = chat.tool_choice
    if choice.mode in ("required", "function"):
        choice = ToolChoice()  # the forced call was made; the model answers now
    if left is None:
        return dataclasses.replace(chat, messages=messages, tool_choice=choice)
    return dataclasses.replace(
        chat,
        messages=messages,
        tool_choice=choice,
        max_tokens=left,
        reasoning_budget=min(chat.reasoning_budget, left),
    )
