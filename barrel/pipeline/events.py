"""What a generation yields, as the dialects' codecs read it: text, reasoning and tool
calls as they come, then `Finished`; with the usage and log-probability values they
carry (barrel.values: the engine's own, passed on unchanged).

A leaf: it imports nothing of Barrel but the leaf barrel.values, so the codecs
(barrel.http.codecs) load, and their golden suites run, where llama.cpp is not
installed; no engine type reaches HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from barrel.values import TokenLogprob, Usage


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
class CallResult:
    """What a server tool answered, or why it did not, as the model reads it. `kind`:
    ok | error (the tool said so) | timeout | failed (the server ended or answered
    nonsense) | refused (not offered, or arguments that are not a JSON object)."""

    output: str
    kind: str = "ok"
    seconds: float = 0.0

    @property
    def error(self) -> bool:
        return self.kind != "ok"


@dataclass(frozen=True)
class ServerResult:
    """The answer to a `ServerCall` (the same id), as the turn reports it."""

    id: str
    server: str
    name: str
    result: CallResult


@dataclass(frozen=True)
class ServerTool:
    """A tool a configured server offers: from its listing (barrel.actors.mcp) to the
    model's prompt and the dialects' output. `parameters`: its input JSON schema."""

    server: str
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ServerTools:
    """The tools a configured server offers this turn (before its first call)."""

    server: str
    tools: tuple[ServerTool, ...]


@dataclass(frozen=True)
class Finished:
    # stop | length | tool_calls | cancelled | context (a server-tool turn whose results
    # outgrew the context window)
    reason: str
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
