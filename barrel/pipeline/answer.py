"""A prepared chat run on the engine: the answer's text through the tool-call and
reasoning parser, as neutral events (barrel.pipeline.events), thinking first where a
grammar or the template asks for it (barrel.pipeline.chat's docstring).

    async for event in answer.run(engine, chat, prep):
        ...
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator

import msgspec

from barrel.engine.engine import Engine
from barrel.engine.types import Done, EngineRequest
from barrel.pipeline.chat import ChatRequest, Prepared
from barrel.pipeline.events import (
    ChatEvent,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.families import family
from barrel.pipeline.prompt import MIN_PIN
from barrel.pipeline.toolcalls import ParseEvent, ToolCallParser
from barrel.values import TokenLogprob, Usage


async def run(
    engine: Engine,
    req: ChatRequest,
    prep: Prepared,
    timings: Callable[[float, float], None] | None = None,
) -> AsyncGenerator[ChatEvent, None]:
    """Generate and parse: text, reasoning and tool calls as they come, then Finished.
    `timings(render_seconds, parse_seconds)` is called at the end (for metrics)."""
    if prep.static_prefix >= MIN_PIN:
        await engine.pin(prep.prompt[: prep.static_prefix], req.scope)
    prompt = list(prep.prompt)
    reused = computed = completion = 0
    reasoning_done = False
    if req.thinking and (prep.grammar is not None or prep.thinking_template):
        # Step 1: free reasoning, streamed as it comes, up to "</think>" or the budget;
        # the block is then closed for the model and the answer continues the sequence.
        opened = engine.tokenize("<think>\n", add_special=False)
        if prompt[-len(opened) :] != opened:
            prompt = [*prompt, *opened]
        first = EngineRequest(
            prompt,
            msgspec.structs.replace(prep.sampling, grammar=None),
            max_tokens=req.reasoning_budget,
            stop=("</think>",),
            session=req.session,
            scope=req.scope,
            preserve=prep.preserve,
            lora=req.lora,
            media=prep.media,
        )
        text = ""
        thought: Done | None = None
        async with engine.submit(first) as thinking_stream:
            async for event in thinking_stream:
                if isinstance(event, Done):
                    thought = event
                    break
                text += event.text
                if event.text and text.strip():
                    yield ReasoningDelta(
                        event.text if text != event.text else event.text.lstrip("\n")
                    )
        assert thought is not None
        reused, computed, completion = _add(thought.usage, 0, 0, 0)
        prompt = [*prompt, *engine.tokenize(text + "</think>\n\n", add_special=False)]
        reasoning_done = True
        sampling = prep.sampling
        if prep.grammar is not None:
            sampling = msgspec.structs.replace(sampling, grammar=prep.grammar)
    else:
        sampling = prep.sampling
    parser = ToolCallParser(
        prep.family if not prep.forced_call else family("generic"),
        prep.tool_names,
        reasoning=not reasoning_done,
    )
    gen = EngineRequest(
        prompt,
        sampling,
        max_tokens=req.max_tokens,
        stop=req.stop,
        session=req.session,
        scope=req.scope,
        preserve=prep.preserve,
        lora=req.lora,
        ignore_eos=req.ignore_eos,
        media=prep.media,
        next_turn=prep.next_turn,
    )
    stream = engine.submit(gen)
    calls = 0
    parse_s = 0.0
    done: Done | None = None
    pending: list[TokenLogprob] = []
    async with stream:
        async for event in stream:
            if isinstance(event, Done):
                done = event
                break
            if event.logprobs:
                pending.extend(event.logprobs)
            start = time.perf_counter()
            parsed_events = parser.feed(event.text)
            parse_s += time.perf_counter() - start
            for out in _events(parsed_events, req, calls, pending, prep.calls_only):
                calls += isinstance(out, ToolCallEvent)
                yield out
    start = time.perf_counter()
    tail = parser.finish()
    parse_s += time.perf_counter() - start
    if timings is not None:
        timings(prep.render_s, parse_s)
    for out in _events(tail, req, calls, pending, prep.calls_only):
        calls += isinstance(out, ToolCallEvent)
        yield out
    assert done is not None
    r, c, g = _add(done.usage, reused, computed, completion)
    usage = Usage(
        prompt_tokens=len(prep.prompt),
        completion_tokens=g,
        prompt_reused=r,
        prompt_computed=c,
        reuse_note=done.usage.reuse_note,
    )
    # A call cut short by the token limit is still a call, but the answer says "length":
    # clients check for exactly that.
    cut = done.finish_reason.value == "length"
    reason = "tool_calls" if calls and not cut else done.finish_reason.value
    yield Finished(
        reason,
        usage,
        done.timings.prefill_s,
        done.timings.decode_s,
        done.stop_sequence,
        tuple(pending),
        (*prompt, *done.answer),
    )


def _events(
    parsed_events: list[ParseEvent],
    req: ChatRequest,
    calls: int,
    pending: list[TokenLogprob],
    calls_only: bool = False,
) -> Iterator[ChatEvent]:
    """The parser's events as the run yields them: logprobs waiting for text attach to
    the next text delta (and `pending` empties); with `parallel_tool_calls` off, calls
    after the first are dropped; `calls_only`: blank text between calls is dropped."""
    for out in parsed_events:
        if calls_only and isinstance(out, TextDelta) and not out.text.strip():
            continue
        if isinstance(out, ToolCallStart | ToolArgsDelta) and calls and not req.parallel_tool_calls:
            continue
        if isinstance(out, ToolCallEvent):
            if calls and not req.parallel_tool_calls:
                continue  # one call per turn was asked for
            calls += 1
        elif isinstance(out, TextDelta) and pending:
            out = TextDelta(out.text, tuple(pending))
            pending.clear()
        yield out


def _add(u: Usage, reused: int, computed: int, completion: int) -> tuple[int, int, int]:
    return reused + u.prompt_reused, computed + u.prompt_computed, completion + u.completion_tokens
