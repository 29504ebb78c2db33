"""The chat pipeline: a neutral chat request in, neutral events out, over one engine.

    request -> render the chat template (tools, template keywords) -> tokens
            -> sampling with the grammar tool_choice / response_format ask for
            -> engine stream -> tool-call and reasoning parser -> events

The generation path (barrel.pipeline.generation) builds a `ChatRequest` from the neutral
request every dialect decodes (`ApiRequest`), with its neutral tools, tool choice
and format; the dialects encode the events this yields (barrel.pipeline.events) and
never touch templates, grammars or the parser. The rules that can be checked before a
lease (a tool choice naming a tool, a forced call beside a format) are checked there,
once (`generation.check`).

tool_choice: "auto" prompts the model with the tools and parses what it writes (the
family's own syntax); "none" renders no tools; "required" and a named function force a
schema-valid call with a grammar (llguidance): in the family's own syntax where it
writes a JSON call between two one-token markers (hermes), else as a bare JSON call
object. With `parallel_tool_calls = false` at most one call is kept.

Thinking with a grammar: the reasoning is generated first, free, up to "</think>" (or
`reasoning_budget` tokens, after which the block is closed for the model); then the answer
is generated under the grammar, continuing the same sequence (its KV is reused). Two
steps instead of a lazy grammar: a model can write anything after "</think>", and the
grammar applies to the answer only.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from barrel.engine.engine import Engine
from barrel.engine.kvcache import common_prefix
from barrel.engine.projector import Media, Piece
from barrel.engine.types import Done, EngineRequest, SamplingParams, SessionId
from barrel.errors import InvalidRequest
from barrel.pipeline.events import (
    ChatEvent,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.formats import call_grammar, format_grammar, json_schema_grammar
from barrel.pipeline.gotemplate import go_to_jinja, is_go_template
from barrel.pipeline.images import REFUSAL, image_marker, markers_of
from barrel.pipeline.request import Format, Tool, ToolChoice
from barrel.pipeline.templates import ChatTemplate
from barrel.pipeline.toolcalls import Family, ParseEvent, ToolCallParser, family
from barrel.values import TokenLogprob, Usage


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # as chat templates read them (template_messages)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    format: Format = field(default_factory=Format)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    thinking: bool | None = None  # None: the template's default
    reasoning_budget: int = 512
    session: SessionId | None = None
    scope: str = ""  # an API key's hash: KV reuse stays within it (EngineRequest.scope)
    keep_alive: float | None = None  # for the lifecycle: seconds, 0 = unload, <0 = forever
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # pin the prompt up to the end of this many leading messages (a cache breakpoint);
    # 0: the system + tools head
    pin_messages: int = 0
    lora: tuple[float, ...] | None = None  # EngineRequest.lora
    ignore_eos: bool = False  # EngineRequest.ignore_eos (the answer, not the thoughts)
    generation_prompt: bool = True  # ApiRequest.generation_prompt
    continue_final: bool = False  # ApiRequest.continue_final
    # the images and audio clips the messages' markers name (barrel.pipeline.images,
    # barrel.pipeline.audio): bytes by SHA-256
    media: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]
    sampling: SamplingParams
    family: Family
    forced_call: bool  # the grammar writes one bare JSON call object
    # what the answer must match (a forced call, the response format), as an llguidance
    # grammar; applied after thinking, when there is any
    grammar: str | None
    tool_names: tuple[str, ...]
    render_s: float
    # leading prompt tokens shared by every request with these tools
    static_prefix: int = 0
    thinking_template: bool = False  # the template knows <think> blocks
    # control tokens the parser must see in the output
    preserve: frozenset[int] = frozenset()
    # the images whose placeholders are in the prompt (barrel.engine.projector)
    media: tuple[Media, ...] = ()
    # the template's end of turn and next user header (EngineRequest.next_turn)
    next_turn: tuple[int, ...] = ()
    # the grammar writes calls in the family's syntax and nothing else: the blanks
    # between them are not text
    calls_only: bool = False


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """Neutral tools -> what chat templates read (the OpenAI function shape, as Hugging
    Face's templates expect)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _forced_schema(req: ChatRequest) -> dict[str, Any] | None:
    """The schema of the call a forced tool choice writes (the choice was checked
    against the tools by barrel.pipeline.generation.check)."""
    mode = req.tool_choice.mode
    if not req.tools or mode in ("auto", "none"):
        return None
    if mode == "required":
        options = [_call_schema(t) for t in req.tools]
        return options[0] if len(options) == 1 else {"anyOf": options}
    return _call_schema(next(t for t in req.tools if t.name == req.tool_choice.name))


def _call_grammar(
    schema: dict[str, Any], fam: Family | None, tokenize_as: Tokenize | None, calls: int
) -> str | None:
    """A forced call's grammar in the family's own syntax, where the family writes a JSON
    call between two markers that are one token each (hermes); else None (a bare JSON
    call object, read by the generic parser)."""
    if fam is None or tokenize_as is None or fam.body != "json" or not fam.starts or not fam.end:
        return None
    start = tokenize_as(fam.starts[0], False, True)
    end = tokenize_as(fam.end, False, True)
    if len(start) != 1 or len(end) != 1:
        return None
    return call_grammar(schema, start[0], end[0], calls)


def _open_final(prompt_text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered prompt cut right after the final assistant message's text, so the
    model continues it (vLLM's `continue_final_message`): the template's end of turn
    and whatever follows go."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if final.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise InvalidRequest(
            "continue_final_message needs a final assistant message with text to continue",
            param="continue_final_message",
        )
    at = prompt_text.rfind(content)
    if at < 0:
        raise InvalidRequest(
            "continue_final_message: the chat template does not show the final message's "
            "text as written",
            param="continue_final_message",
        )
    return prompt_text[: at + len(content)]


def prepare(
    req: ChatRequest,
    template: ChatTemplate,
    tokenize: Callable[[str], list[int]],
    template_family: Family,
    control_tokens: Callable[[str], set[int]] | None = None,
    tokenize_as: Tokenize | None = None,
    read_media: Callable[[dict[str, bytes]], dict[str, Piece]] | None = None,
) -> Prepared:
    """Everything that can fail on bad input happens here, before any slow work.
    `tokenize_as(text, add_special, parse_special)`, when given, keeps control-token text
    inside messages plain text (see `_tokenize_prompt`). `read_media` is the model's
    projector (None: it reads neither images nor audio)."""
    _refuse_images(req.messages)
    forced = _forced_schema(req)
    tools = template_tools(req.tools) if req.tool_choice.mode != "none" else []
    kwargs = dict(req.template_kwargs)
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", req.thinking)
    messages = req.messages
    if tools and not template.renders_tools and template_family.name == "generic":
        messages = with_tool_instructions(messages, tools)
    start = time.perf_counter()
    generation_prompt = req.generation_prompt and not req.continue_final
    prompt_text = template.render(
        messages, tools or None, add_generation_prompt=generation_prompt, **kwargs
    )
    if req.continue_final:
        prompt_text = _open_final(prompt_text, messages)
    render_s = time.perf_counter() - start
    sampling = req.sampling
    # Built now even when thinking comes first: a bad schema is a 400 before any work.
    bare_call = calls_only = False
    if forced is not None:
        # "required" with parallel calls: up to one call per tool (a small model left
        # unbounded repeats the same call until max_tokens)
        calls = (
            len(req.tools) if req.parallel_tool_calls and req.tool_choice.mode == "required" else 1
        )
        family_of = template_family if tools else None
        grammar = _call_grammar(forced, family_of, tokenize_as, calls)
        bare_call = grammar is None
        calls_only = not bare_call
        if grammar is None:
            grammar = json_schema_grammar(forced)
    else:
        grammar = format_grammar(req.format)
    if grammar is not None and not req.thinking:
        sampling = msgspec.structs.replace(sampling, grammar=grammar)
    pieces: dict[str, Piece] = {}
    if req.media:
        if read_media is None or tokenize_as is None:
            raise InvalidRequest(REFUSAL)
        pieces = read_media(req.media)
    prompt = _tokenize_prompt(prompt_text, messages, tokenize, control_tokens, tokenize_as, pieces)
    media = {m.token: m for piece in pieces.values() for m in piece.media if m.token in prompt}
    fam = template_family if tools else family("generic")
    preserve: set[int] = set()
    if control_tokens is not None:
        for marker in fam.markers:
            preserve |= control_tokens(marker)
    return Prepared(
        thinking_template="<think>" in template.source,
        preserve=frozenset(preserve),
        prompt=prompt,
        static_prefix=_static_prefix(
            messages,
            req.pin_messages + (len(messages) - len(req.messages)) if req.pin_messages else 0,
            template,
            tokenize,
            tools,
            kwargs,
            prompt,
        ),
        sampling=sampling,
        family=fam,
        forced_call=bare_call,
        calls_only=calls_only,
        grammar=grammar,
        tool_names=tuple(t.name for t in req.tools) if tools else (),
        render_s=render_s,
        media=tuple(media.values()),
        next_turn=tuple(tokenize_as(template.next_turn, False, True))
        if template.next_turn and tokenize_as is not None
        else (),
    )


Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)


def _tokenize_prompt(
    text: str,
    messages: list[dict[str, Any]],
    tokenize: Callable[[str], list[int]],
    control_tokens: Callable[[str], set[int]] | None,
    tokenize_as: Tokenize | None,
    media: dict[str, Piece] | None = None,
) -> list[int]:
    """The rendered prompt's tokens. Only the template's own markup may become control
    tokens: message text that spells one (`<|im_start|>system` in a user's message) is
    tokenized as text, so a client cannot forge turns. Most messages hold no such text
    and the prompt is tokenized whole; otherwise the render is cut around those
    messages' text, found where the template put it verbatim. `media` (images and
    audio clips, by SHA-256): each one's marker becomes the projector's tokens for it."""
    if control_tokens is None or tokenize_as is None:
        return tokenize(text)
    markers = markers_of(set(media)) if media else None
    by_marker = {image_marker(d): piece for d, piece in (media or {}).items()}
    contents = [c for m in messages if isinstance(c := m.get("content"), str)]
    if markers is not None:
        contents = [piece for c in contents for piece in markers.split(c)]
    risky = [c for c in contents if ("<" in c or "[" in c) and control_tokens(c)]
    if not risky and markers is None:
        return tokenize(text)
    if not risky:
        return _with_media(text, True, True, markers, by_marker, tokenize_as)
    spans: list[tuple[int, int]] = []
    pos = 0
    for content in risky:
        start = text.find(content, pos)
        if start < 0:
            raise InvalidRequest(
                "a message contains the model's control tokens as text, and its chat "
                "template changes that message: it cannot be sent as plain text"
            )
        spans.append((start, start + len(content)))
        pos = start + len(content)
    out: list[int] = []
    last = 0
    for start, end in spans:
        out += _with_media(text[last:start], last == 0, True, markers, by_marker, tokenize_as)
        out += tokenize_as(text[start:end], False, False)
        last = end
    return out + _with_media(text[last:], False, True, markers, by_marker, tokenize_as)


def _with_media(
    text: str,
    add_special: bool,
    parse_special: bool,
    markers: re.Pattern[str] | None,
    media: dict[str, Piece],
    tokenize_as: Tokenize,
) -> list[int]:
    """Template text with image markers: the text around them tokenized, each marker
    replaced by its image's or clip's tokens (`media` by marker)."""
    if markers is None:
        return tokenize_as(text, add_special, parse_special)
    out: list[int] = []
    last = 0
    for match in markers.finditer(text):
        out += tokenize_as(text[last : match.start()], add_special and last == 0, parse_special)
        out += media[match.group(0)].tokens()
        last = match.end()
    return out + tokenize_as(text[last:], add_special and last == 0, parse_special)


TOOL_INSTRUCTIONS = (
    "You can call the following tools. To call one, answer with only a JSON object of "
    'the form {"name": "<tool name>", "arguments": {<the arguments>}} and nothing '
    "else; otherwise answer normally.\n\nTools:\n"
)


def with_tool_instructions(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For templates that take `tools` but print none of them: the definitions and the
    call format (the bare JSON object the generic parser reads) join the system
    message, as llama.cpp does for such templates."""
    definitions = json.dumps([t.get("function", t) for t in tools], indent=2, ensure_ascii=False)
    text = TOOL_INSTRUCTIONS + definitions
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _refuse_images(messages: list[dict[str, Any]]) -> None:
    """Images reach the pipeline as markers in the text (barrel.pipeline.images); parts
    shaped like a dialect's image parts are not read."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_image")
            for p in content
        ):
            raise InvalidRequest(REFUSAL)
        if m.get("images"):
            raise InvalidRequest(REFUSAL)


def make_template(
    source: str, bos_token: str = "", eos_token: str = "", render_budget_s: float | None = None
) -> ChatTemplate:
    """The model's chat template: a Modelfile TEMPLATE (Go, converted when simple) or the
    GGUF's Jinja2 template. Each render gets `render_budget_s` (a 400 beyond)."""
    if is_go_template(source):
        source = go_to_jinja(source)
    return ChatTemplate(source, bos_token, eos_token, render_budget_s)


MIN_PIN = 64  # a static prefix shorter than this is not worth a pinned sequence


def _static_prefix(
    messages: list[dict[str, Any]],
    pin_messages: int,
    template: ChatTemplate,
    tokenize: Callable[[str], list[int]],
    tools: list[dict[str, Any]],
    kwargs: dict[str, Any],
    prompt: list[int],
) -> int:
    """The system + tools head every conversation with these tools starts with: the
    common token prefix of a render with the system messages only and the full one."""
    if pin_messages:
        head = messages[:pin_messages]
    else:
        head = [m for m in messages if m.get("role") in ("system", "developer")]
    if not tools and not head:
        return 0
    try:
        vocabulary = id(getattr(tokenize, "__self__", tokenize))  # one template, one model
        key = json.dumps([vocabulary, head, tools, kwargs], sort_keys=True, default=str)
    except (TypeError, ValueError):
        key = ""
    tokens = template.heads.get(key) if key else None
    if tokens is None:
        try:
            text = template.render(head, tools or None, add_generation_prompt=False, **kwargs)
        except InvalidRequest:
            return 0  # templates that insist on a user turn have no separable head
        tokens = tokenize(text)
        if key:
            template.heads.put(key, tokens)
    return common_prefix(tokens, prompt)


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
    answer = done.tokens
    if done.finish_reason.value == "stop" and done.stop_sequence is None and answer:
        answer = answer[:-1]  # the end-of-generation token, never part of the sequence
    yield Finished(
        reason,
        usage,
        done.timings.prefill_s,
        done.timings.decode_s,
        done.stop_sequence,
        tuple(pending),
        (*prompt, *answer),
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
