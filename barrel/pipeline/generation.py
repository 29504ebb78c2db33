"""The one generation path every generating endpoint takes, whatever its dialect:

    check(req)                          before any lease (400s)
    gen = await start(session, req)     under the lease
    async for i, event in merged(gen.runs): ...

For a chat turn, `start` puts the model's stored MESSAGEs and SYSTEM in front, merges
the sampling (barrel.pipeline.sampling), renders the chat template with thinking as the
request and the template want it, derives the KV session, prepares the prompt in a
worker thread (barrel.pipeline.prompt.prepare) and starts `n` runs (barrel.pipeline.answer.
run): the first continues the conversation's KV session, the others are new sequences.
A prompt without a chat template (`req.completion`: OpenAI's completions, Ollama's raw
prompt and suffix) skips all that: its prompts are tokenized as given and run unparsed
(barrel.pipeline.complete).

`session` is a `ModelSession` (barrel.actors), seen here through the `ModelAccess`
protocol: the pipeline does not import the actor layer. The session hands out the model
and its engine; every step above is the pipeline's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import msgspec

from barrel.config import LimitsConfig
from barrel.engine.engine import Engine
from barrel.engine.types import EngineRequest, SamplingParams, SessionId
from barrel.errors import InvalidRequest
from barrel.pipeline import answer, audio, complete, images, prompt, servertools
from barrel.pipeline.chat import ChatRequest, Prepared
from barrel.pipeline.events import ChatEvent
from barrel.pipeline.families import detect_family
from barrel.pipeline.formats import check_size, format_grammar
from barrel.pipeline.request import (
    ApiRequest,
    Dialect,
    Message,
    TextPart,
    Tool,
    ToolChoice,
)
from barrel.pipeline.servertools import Toolbox
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import ChatTemplate

logger = logging.getLogger(__name__)

# reasoning tokens allowed before the thinking block is closed for the model
EFFORT_BUDGETS = {"minimal": 64, "low": 256, "medium": 512, "high": 1024, "xhigh": 2048}
DEFAULT_BUDGET = 512
MAX_SERVERS = 16  # tool servers one request names


class ModelAccess(Protocol):
    """What the generation path needs of a model session."""

    @property
    def name(self) -> str: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def adapters(self) -> int: ...

    def sampling(
        self, dialect: Dialect, options: dict[str, Any]
    ) -> tuple[SamplingParams, int | None, tuple[str, ...]]: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def timings(self) -> Callable[[float, float], None] | None:
        """Called with (render seconds, parse seconds) after each chat run (metrics)."""
        ...

    def check_tokens(self, tokens: list[int], param: str) -> None: ...

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def piece(self, token: int, *, special: bool = False) -> str: ...

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]: ...

    @property
    def stored_messages(self) -> tuple[dict[str, Any], ...]: ...

    @property
    def stored_system(self) -> str | None: ...

    async def template(self) -> ChatTemplate: ...


@dataclasses.dataclass
class Generation:
    runs: list[AsyncGenerator[ChatEvent, None]]
    prompt: list[int]  # the (first) prompt's tokens
    # per run, the text in front of its answer (a completion's echo)
    echo: tuple[str, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


def check(req: ApiRequest, limits: LimitsConfig) -> None:
    """What can be refused before any lease, whatever the dialect and route: every count
    and size the client chose is within `limits`, and the tool choice fits the tools."""
    if len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are allowed")
    if len(req.tools) > limits.max_tools:
        raise InvalidRequest(f"at most {limits.max_tools} tools are allowed")
    images.check(req, limits)
    audio.check(req, limits)
    stops = [*(req.options.stop or ()), *req.stop]
    if len(stops) > limits.max_stop:
        raise InvalidRequest(f"at most {limits.max_stop} stop strings are allowed", param="stop")
    if any(len(s) > limits.max_stop_length for s in stops):
        raise InvalidRequest(
            f"a stop string may have at most {limits.max_stop_length} characters", param="stop"
        )
    if req.runs > limits.max_sequences:
        prompts = req.runs // req.n
        raise InvalidRequest(
            f"{prompts} prompts x n={req.n} is more than the {limits.max_sequences} "
            "sequences one request may run"
            if prompts > 1
            else f"n may be at most {limits.max_sequences}",
            param="prompt" if prompts > 1 else "n",
        )
    fmt = req.format
    if fmt.kind != "text":
        spec: Any = fmt.schema if fmt.kind == "json_schema" else [fmt.text, fmt.choices]
        check_size(spec, where="the response format", max_bytes=limits.max_schema_bytes)
    for tool in req.tools:
        check_size(
            tool.parameters, where=f"the tool {tool.name!r}", max_bytes=limits.max_schema_bytes
        )
    choice = req.tool_choice
    if not req.servers:  # else once the servers' tools are known (_prepared)
        _check_choice(choice, req.tools)
    forced = req.tools and choice.mode in ("required", "function")
    if forced and req.format.kind != "text":
        raise InvalidRequest("a forced tool call and a response_format cannot be combined")
    if req.servers and req.runs > 1:
        raise InvalidRequest("a turn with tool servers has one answer: n must be 1", param="n")
    if len(req.servers) > MAX_SERVERS:
        raise InvalidRequest(f"at most {MAX_SERVERS} tool servers a request")


def _check_choice(choice: ToolChoice, tools: tuple[Tool, ...]) -> None:
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise InvalidRequest(
            f"tool_choice names {choice.name!r}, which is not among the tools",
            param="tool_choice",
        )


def template_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """Neutral messages -> the dicts chat templates read (Hugging Face's convention).
    An image is its marker in the text, where it was among the message's parts."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.text
        if m.media:
            content = "".join(
                p.text if isinstance(p, TextPart) else images.image_marker(images.digest_of_part(p))
                for p in m.parts
            )
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        out.append(d)
    return out


def with_model_messages(
    session: ModelAccess, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """The model's stored messages, then its SYSTEM (unless the request has a system
    message), then the request's; and how many were put in front."""
    head = [dict(m) for m in session.stored_messages]
    system = session.stored_system
    if system and not any(m["role"] == "system" for m in messages):
        head.append({"role": "system", "content": system})
    return [*head, *messages], len(head)


def thinking_of(req: ApiRequest, template: ChatTemplate) -> tuple[bool | None, dict[str, Any]]:
    """Whether the model thinks, and the template's extra arguments: an explicit
    `enable_thinking` template argument wins, then the request's thinking; an effort of
    "none" turns it off, any other turns it on for a template that knows <think> blocks
    (and reaches the template as `reasoning_effort`)."""
    kwargs = dict(req.template_kwargs)
    effort = req.reasoning_effort
    if effort and effort != "none":
        kwargs.setdefault("reasoning_effort", effort)
    if isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"], kwargs
    if req.thinking is not None:
        return req.thinking, kwargs
    if effort == "none":
        return False, kwargs
    if effort is not None and "<think>" in template.source:
        return True, kwargs
    return None, kwargs


def _sampling(
    session: ModelAccess, req: ApiRequest, limits: LimitsConfig | None
) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    sampling, predict, stop = session.sampling(req.dialect, req.options.given())
    if req.logit_bias:
        session.check_tokens(list(req.logit_bias), "logit_bias")
        sampling = msgspec.structs.replace(sampling, logit_bias=dict(req.logit_bias))
    if req.logprobs is not None:
        sampling = msgspec.structs.replace(sampling, logprobs=req.logprobs)
    limit = req.max_tokens if req.max_tokens is not None else predict
    cap = limits.max_tokens if limits is not None else 0
    if cap:
        limit = cap if limit is None else min(limit, cap)
    return sampling, limit, (*stop, *req.stop)


def _session(model: str, messages: list[dict[str, Any]], req: ApiRequest) -> SessionId:
    """The KV session: the client's conversation id (or a hash of the conversation's
    start), inside the request's scope."""
    session = derive_session(model, messages, req.conversation, req.user)
    return SessionId(f"{req.scope}/{session}") if req.scope else session


async def start(
    session: ModelAccess,
    req: ApiRequest,
    limits: LimitsConfig | None = None,
    toolbox: Toolbox | None = None,
    max_rounds: int = 8,
) -> Generation:
    """Everything between the lease and the first token (see the module's docstring).
    `toolbox`: the configured servers' tools the request may use; their calls are run
    and the turn goes on, at most `max_rounds` times (barrel.pipeline.servertools)."""
    if req.completion is not None:
        return await _completion(session, req, limits)
    chat, prep = await _prepared(session, req, limits, toolbox)
    engine, timings = session.engine, session.timings
    if toolbox is not None and toolbox.tools:
        template = await session.template()

        async def render(turn: ChatRequest) -> Prepared:
            return await _render(session, turn, template)

        turn = servertools.run(engine, chat, prep, toolbox, render, max_rounds, timings)
        return Generation([turn], prep.prompt)
    runs = [answer.run(engine, chat, prep, timings)]
    alone = dataclasses.replace(chat, session=None)
    runs += [answer.run(engine, alone, prep, timings) for _ in range(req.n - 1)]
    return Generation(runs, prep.prompt)


async def prepare(
    session: ModelAccess, req: ApiRequest, limits: LimitsConfig | None = None
) -> Prepared:
    """The prompt `start` would run, without running it (counting tokens)."""
    return (await _prepared(session, req, limits))[1]


async def _completion(
    session: ModelAccess, req: ApiRequest, limits: LimitsConfig | None
) -> Generation:
    completion = req.completion
    assert completion is not None
    sampling, max_tokens, stop = _sampling(session, req, limits)
    if max_tokens is None:
        max_tokens = completion.default_max_tokens
    grammar = await asyncio.to_thread(format_grammar, req.format)  # GBNF is read in Python
    await _compile(session, grammar, limits)
    sampling = msgspec.structs.replace(sampling, grammar=grammar)
    prompts = await asyncio.to_thread(complete.tokens, session, completion)
    if req.truncate:
        prompts = [_fit(p, session.n_ctx, max_tokens) for p in prompts]
    echoes = await asyncio.to_thread(complete.echoes, session, completion, prompts)
    lora = lora_scales(req.lora, session.adapters)
    engine = session.engine
    runs = [
        complete.run(
            engine,
            EngineRequest(
                prompt,
                sampling,
                max_tokens=max_tokens,
                stop=stop,
                prompt_logprobs=completion.prompt_logprobs,
                scope=req.scope,
                lora=lora,
                ignore_eos=req.ignore_eos,
            ),
            session.piece,
        )
        for prompt in prompts
        for _ in range(req.n)
    ]
    return Generation(runs, prompts[0], tuple(e for e in echoes for _ in range(req.n)))


async def _render(session: ModelAccess, chat: ChatRequest, template: ChatTemplate) -> Prepared:
    """Render and tokenize in a worker thread (a template is client input: its render
    time is bounded, and never spent on the event loop); bad input fails here, before
    the engine sees it."""
    engine = session.engine
    model = engine.model
    projector = engine.projector

    def tokenize_as(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return model.tokenize(text, add_special=add_special, parse_special=parse_special)

    return await asyncio.to_thread(
        prompt.prepare,
        chat,
        template,
        model.tokenize,
        detect_family(template.source),
        model.control_tokens,
        tokenize_as,
        projector.read if projector is not None else None,
    )


async def _compile(session: ModelAccess, grammar: str | None, limits: LimitsConfig | None) -> None:
    """Compile `grammar` for the model in a worker thread (kept, so the engine's copy is
    cheap): what llguidance refuses is a 400 with its reason, before the request takes a
    sequence."""
    if grammar is None:
        return
    if limits is not None and len(grammar) > limits.max_grammar_bytes:
        raise InvalidRequest(
            f"the grammar has {len(grammar)} bytes; at most {limits.max_grammar_bytes}"
        )
    await asyncio.to_thread(session.engine.grammars.matcher, grammar)


async def _prepared(
    session: ModelAccess,
    req: ApiRequest,
    limits: LimitsConfig | None,
    toolbox: Toolbox | None = None,
) -> tuple[ChatRequest, Prepared]:
    messages, before = with_model_messages(session, template_messages(req.messages))
    tools = req.tools
    if toolbox is not None and toolbox.tools:
        tools = with_server_tools(req.tools, toolbox)
    _check_choice(req.tool_choice, tools)
    if req.tool_choice.server:
        served = toolbox.tools if toolbox is not None else ()
        if not any(
            t.name == req.tool_choice.name and t.server == req.tool_choice.server for t in served
        ):
            raise InvalidRequest(
                f"tool_choice names {req.tool_choice.name!r} of the tool server "
                f"{req.tool_choice.server!r}, which this request may not use",
                param="tool_choice",
            )
    sampling, max_tokens, stop = _sampling(session, req, limits)
    template = await session.template()
    thinking, kwargs = thinking_of(req, template)
    budget = req.reasoning_budget or EFFORT_BUDGETS.get(req.reasoning_effort or "", DEFAULT_BUDGET)
    if limits is not None and limits.max_tokens:
        budget = min(budget, limits.max_tokens)
    chat = ChatRequest(
        messages,
        tools=tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        format=req.format,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        thinking=thinking,
        reasoning_budget=budget,
        session=_session(session.name, messages, req),
        scope=req.scope,
        keep_alive=req.keep_alive,
        template_kwargs=kwargs,
        pin_messages=before + req.pin_messages if req.pin_messages else 0,
        lora=lora_scales(req.lora, session.adapters),
        ignore_eos=req.ignore_eos,
        generation_prompt=req.generation_prompt,
        continue_final=req.continue_final,
        media={images.digest_of_part(i): i.data for m in req.messages for i in m.media},
    )
    prep = await _render(session, chat, template)
    await _compile(session, prep.grammar, limits)
    if req.context:
        session.check_tokens(list(req.context), "context")
        prep = dataclasses.replace(prep, prompt=[*req.context, *prep.prompt], static_prefix=0)
    if req.truncate and len(prep.prompt) > _budget(session.n_ctx, max_tokens):
        if prep.media:
            raise InvalidRequest(
                f"the prompt with its images has {len(prep.prompt)} tokens; "
                f"the context holds {session.n_ctx}"
            )
        prep = dataclasses.replace(
            prep, prompt=_fit(prep.prompt, session.n_ctx, max_tokens), static_prefix=0
        )
    return chat, prep


def with_server_tools(tools: tuple[Tool, ...], toolbox: Toolbox) -> tuple[Tool, ...]:
    """The client's tools, then the servers': one name, one tool (a 400 otherwise)."""
    names = {t.name for t in tools}
    out = list(tools)
    for tool in toolbox.tools:
        if tool.name in names:
            raise InvalidRequest(
                f"the tool name {tool.name!r} is offered twice (by the request or another "
                f"server, and by the tool server {tool.server!r})",
                param="tools",
            )
        names.add(tool.name)
        out.append(Tool(tool.name, tool.description, tool.parameters or {"type": "object"}))
    return tuple(out)


# Ollama keeps the first tokens of a prompt that does not fit (its num_keep default).
NUM_KEEP = 4


def lora_scales(
    pairs: tuple[tuple[int, float], ...] | None, adapters: int
) -> tuple[float, ...] | None:
    """llama-server's `lora` field as one scale per adapter (those not named: 0)."""
    if pairs is None:
        return None
    scales = [0.0] * adapters
    for adapter, scale in pairs:
        if not 0 <= adapter < adapters:
            raise InvalidRequest(
                f"lora: no adapter {adapter}; this model has {adapters}", param="lora"
            )
        scales[adapter] = scale
    return tuple(scales)


def _budget(n_ctx: int, max_tokens: int | None) -> int:
    """The tokens a truncated prompt may keep: room for the answer is kept too (Barrel
    does not shift the context mid-answer)."""
    return n_ctx - min(max_tokens or 256, n_ctx // 4)


def _fit(prompt: list[int], n_ctx: int, max_tokens: int | None) -> list[int]:
    """Ollama's answer to a prompt longer than the context is to drop tokens after the
    first NUM_KEEP (the oldest of the conversation) until it fits, not to refuse it."""
    budget = _budget(n_ctx, max_tokens)
    if len(prompt) <= budget:
        return prompt
    logger.warning("truncating a prompt of %d tokens to %d (Ollama's way)", len(prompt), budget)
    return [*prompt[:NUM_KEEP], *prompt[len(prompt) - (budget - NUM_KEEP) :]]
