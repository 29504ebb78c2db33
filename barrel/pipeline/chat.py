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

from dataclasses import dataclass, field
from typing import Any

from barrel.engine.projector import Media
from barrel.engine.types import SamplingParams, SessionId
from barrel.pipeline.families import Family
from barrel.pipeline.request import Format, Tool, ToolChoice


@dataclass
class ChatRequest:
    """One chat as the pipeline runs it: the messages as templates read them, the
    neutral tools, choice and format, and the engine's options."""

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
    """A chat made ready for the engine (barrel.pipeline.prompt.prepare): its prompt
    tokens, sampling and grammar, and what the run needs to parse the answer."""

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
