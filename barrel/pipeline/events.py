"""What a generation yields, as the dialects' codecs read it: text, reasoning and tool
calls as they come, then `Finished`; with the usage and log-probability values they
carry.

A leaf: it imports nothing of Barrel, so the codecs (barrel.http.codecs) load, and their
golden suites run, where llama.cpp is not installed. The engine has value types of its
own (barrel.engine.types); the pipeline turns them into these (barrel.pipeline.chat,
barrel.pipeline.complete), so no engine type reaches HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TopLogprob:
    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability given the tokens before it, and the top ones.
    `logprob` is None only for a prompt's first token (nothing before it)."""

    token: int
    text: str
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prompt_reused: int  # taken from the KV cache (a parked sequence or the state cache)
    prompt_computed: int  # prefilled this time
    # Why less was reused than a prefix matched ("" when reuse went as planned).
    reuse_note: str = ""


@dataclass(frozen=True)
class TextDelta:
    text: str
    # log-probabilities of the tokens generated since the previous event (when asked)
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins (its name is known): its arguments follow as they are written
    (ToolArgsDelta), then the whole call (ToolCallEvent, `streamed`)."""

    id: str
    name: str


@dataclass(frozen=True)
class ToolArgsDelta:
    """The next piece of the arguments of the call that started last, as the model
    wrote them: the pieces make the call's arguments, as JSON text."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A whole tool call the model made: `arguments` is its JSON text. `streamed`: its
    start and arguments went out before (ToolCallStart, ToolArgsDelta), under this id."""

    id: str
    name: str
    arguments: str
    streamed: bool = False


@dataclass(frozen=True)
class ServerCall:
    """The model called a tool of a configured tool server; Barrel runs it
    (barrel.pipeline.servertools) and the turn goes on. `arguments`: JSON text."""

    id: str
    server: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ServerResult:
    """What a server tool answered (or why it did not), as the model sees it."""

    id: str
    server: str
    name: str
    output: str
    error: bool = False


@dataclass(frozen=True)
class ServerTools:
    """The tools a configured server offers this turn (before its first call)."""

    server: str
    tools: tuple[tuple[str, str, dict[str, Any]], ...]  # name, description, input schema


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | tool_calls | cancelled
    usage: Usage
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_sequence: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # those not yet attached to a TextDelta
    # the whole sequence: the prompt (with any reasoning step) and the answer's tokens,
    # an end-of-generation token left out (Ollama's /api/generate `context`)
    context: tuple[int, ...] = ()
    # a completion's prompt scored (Completion.prompt_logprobs): one entry per prompt
    # token, the first without a logprob
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


ChatEvent = (
    TextDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolArgsDelta
    | ToolCallEvent
    | ServerTools
    | ServerCall
    | ServerResult
    | Finished
)
