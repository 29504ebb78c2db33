"""The one generation path every chat-shaped endpoint takes, whatever its dialect:

    check(req)                          before any lease (400s)
    gen = await start(session, req)     under the lease
    async for i, event in merged(gen.runs): ...

`start` puts the model's stored MESSAGEs and SYSTEM in front, merges the sampling
(barrel.pipeline.sampling), renders the chat template with thinking as the request and
the template want it, derives the KV session, prepares the prompt (off the loop unless it
is small) and starts `n` runs of the pipeline: the first continues the conversation's KV
session, the others are new sequences.

`session` is a `ModelSession` (barrel.actors), seen here through the `ModelAccess`
protocol: the pipeline does not import the actor layer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import Any, Protocol

import msgspec

from barrel.config import LimitsConfig
from barrel.errors import InvalidRequest
from barrel.pipeline import images
from barrel.pipeline.chat import ChatEvent, ChatRequest, Prepared
from barrel.pipeline.grammar import check_schema
from barrel.pipeline.request import GenerateRequest, Message, TextPart
from barrel.pipeline.sampling import Dialect
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import ChatTemplate
from barrel.pipeline.types import SamplingParams, SessionId

logger = logging.getLogger(__name__)

# reasoning tokens allowed before the thinking block is closed for the model
EFFORT_BUDGETS = {"minimal": 64, "low": 256, "medium": 512, "high": 1024, "xhigh": 2048}
DEFAULT_BUDGET = 512
# A template for prompts given whole (raw, fill-in-the-middle): the text as it is.
VERBATIM = ChatTemplate("{{ messages[-1].content }}")


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

    def check_tokens(self, tokens: list[int], param: str) -> None: ...

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]: ...

    def with_model_messages(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int]: ...

    async def template(self) -> ChatTemplate: ...

    async def prepare(self, req: ChatRequest, template: ChatTemplate) -> Prepared: ...

    def run(self, req: ChatRequest, prep: Prepared) -> AsyncGenerator[ChatEvent, None]: ...


@dataclasses.dataclass
class Generation:
    prep: Prepared
    runs: list[AsyncGenerator[ChatEvent, None]]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prep.prompt)


def check(req: GenerateRequest, limits: LimitsConfig) -> None:
    """What can be refused before any lease, whatever the dialect: every size the client
    chose is within `limits`."""
    images.check(req, limits)
    stops = [*(req.options.stop or ()), *req.stop]
    if len(stops) > limits.max_stop:
        raise InvalidRequest(f"at most {limits.max_stop} stop strings are allowed", param="stop")
    if any(len(s) > limits.max_stop_length for s in stops):
        raise InvalidRequest(
            f"a stop string may have at most {limits.max_stop_length} characters", param="stop"
        )
    if req.n > limits.max_sequences:
        raise InvalidRequest(f"n may be at most {limits.max_sequences}", param="n")
    schema_limits = {"max_bytes": limits.max_schema_bytes, "max_repeat": limits.max_schema_repeat}
    if req.format.schema is not None:
        check_schema(req.format.schema, where="the response format", **schema_limits)
    for tool in req.tools:
        check_schema(tool.parameters, where=f"the tool {tool.name!r}", **schema_limits)
    if req.tool_choice.mode == "function" and req.tool_choice.name not in {
        t.name for t in req.tools
    }:
        raise InvalidRequest(
            f"tool_choice names {req.tool_choice.name!r}, which is not among the tools",
            param="tool_choice",
        )
    if req.format.kind == "json_schema" and not isinstance(req.format.schema, dict):
        raise InvalidRequest("the response format's schema must be an object")


def template_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """Neutral messages -> the dicts chat templates read (Hugging Face's convention).
    An image is its marker in the text, where it was among the message's parts."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.text
        if m.images:
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


def _tools(req: GenerateRequest) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in req.tools
    ]


def _tool_choice(req: GenerateRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    if choice.mode == "function":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def _response_format(req: GenerateRequest) -> dict[str, Any] | None:
    fmt = req.format
    if fmt.kind == "json_object":
        return {"type": "json_object"}
    if fmt.kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.schema}}
    return None


def thinking_of(req: GenerateRequest, template: ChatTemplate) -> tuple[bool | None, dict[str, Any]]:
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
    session: ModelAccess, req: GenerateRequest
) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    sampling, predict, stop = session.sampling(req.dialect, req.options.given())
    if req.logit_bias:
        session.check_tokens(list(req.logit_bias), "logit_bias")
        sampling = msgspec.structs.replace(sampling, logit_bias=dict(req.logit_bias))
    if req.logprobs is not None:
        sampling = msgspec.structs.replace(sampling, logprobs=req.logprobs)
    limit = req.max_tokens if req.max_tokens is not None else predict
    return sampling, limit, (*stop, *req.stop)


def _session(model: str, messages: list[dict[str, Any]], req: GenerateRequest) -> SessionId:
    """The KV session: the client's conversation id (or a hash of the conversation's
    start), inside the request's scope."""
    session = derive_session(model, messages, req.conversation, req.user)
    return SessionId(f"{req.scope}/{session}") if req.scope else session


def _raw_prompt(session: ModelAccess, req: GenerateRequest) -> list[int] | None:
    raw = req.raw
    if raw is None:
        return None
    if raw.suffix:
        return session.fim_prompt(raw.prompt, raw.suffix)
    if raw.raw:
        return session.tokenize(raw.prompt, add_special=True)
    return None


async def start(
    session: ModelAccess, req: GenerateRequest, limits: LimitsConfig | None = None
) -> Generation:
    """Everything between the lease and the first token (see the module's docstring)."""
    chat, prep = await _prepared(session, req, limits)
    runs = [session.run(chat, prep)]
    runs += [session.run(dataclasses.replace(chat, session=None), prep) for _ in range(req.n - 1)]
    return Generation(prep, runs)


async def prepare(
    session: ModelAccess, req: GenerateRequest, limits: LimitsConfig | None = None
) -> Prepared:
    """The prompt `start` would run, without running it (counting tokens)."""
    return (await _prepared(session, req, limits))[1]


async def _prepared(
    session: ModelAccess, req: GenerateRequest, limits: LimitsConfig | None
) -> tuple[ChatRequest, Prepared]:
    messages, before = session.with_model_messages(template_messages(req.messages))
    sampling, max_tokens, stop = _sampling(session, req)
    verbatim = _raw_prompt(session, req)
    template = VERBATIM if verbatim is not None else await session.template()
    thinking, kwargs = thinking_of(req, template)
    budget = req.reasoning_budget or EFFORT_BUDGETS.get(req.reasoning_effort or "", DEFAULT_BUDGET)
    chat = ChatRequest(
        messages,
        tools=_tools(req),
        tool_choice=_tool_choice(req),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req),
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
        images={images.digest_of_part(i): i.data for m in req.messages for i in m.images},
    )
    prep = await session.prepare(chat, template)
    grammar_bytes = len(prep.grammar or "")
    if limits is not None and grammar_bytes > limits.max_grammar_bytes:
        raise InvalidRequest(
            f"the schema's grammar has {grammar_bytes} bytes; at most {limits.max_grammar_bytes}"
        )
    if verbatim is not None:
        prep = dataclasses.replace(prep, prompt=verbatim, static_prefix=0)
    elif req.raw is not None and req.raw.context:
        session.check_tokens(list(req.raw.context), "context")
        prep = dataclasses.replace(prep, prompt=[*req.raw.context, *prep.prompt], static_prefix=0)
    if req.dialect is Dialect.OLLAMA:
        prep = _fit(prep, session.n_ctx, max_tokens)
    return chat, prep


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


def _fit(prep: Prepared, n_ctx: int, max_tokens: int | None) -> Prepared:
    """Ollama's answer to a prompt longer than the context is to drop tokens after the
    first NUM_KEEP (the oldest of the conversation) until it fits, not to refuse it;
    room for the answer is kept too (Barrel does not shift the context mid-answer)."""
    room = min(max_tokens or 256, n_ctx // 4)
    budget = n_ctx - room
    prompt = prep.prompt
    if len(prompt) <= budget:
        return prep
    if prep.media:
        raise InvalidRequest(
            f"the prompt with its images has {len(prompt)} tokens; the context holds {n_ctx}"
        )
    logger.warning("truncating a prompt of %d tokens to %d (Ollama's way)", len(prompt), budget)
    kept = [*prompt[:NUM_KEEP], *prompt[len(prompt) - (budget - NUM_KEEP) :]]
    return dataclasses.replace(prep, prompt=kept, static_prefix=0)
