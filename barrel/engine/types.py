"""What goes into the engine and what comes out of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, NewType

import msgspec

from barrel.values import TokenLogprob, Usage

if TYPE_CHECKING:
    from barrel.engine.projector import Media

RequestId = NewType("RequestId", int)
SessionId = NewType("SessionId", str)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Every sampling option the three APIs pass, in llama.cpp's terms."""

    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # <= 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    typical_p: float = 1.0  # 1.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # -1: the whole context
    seed: int | None = None  # None: random
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    mirostat: int = 0  # 0 off, 1 v1, 2 v2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0  # 0.0: off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = msgspec.field(default_factory=lambda: ["\n", ":", '"', "*"])
    # An llguidance grammar (its JSON form, or Lark text; barrel.engine.grammar) the
    # output must match: the sequence ends where the grammar does.
    grammar: str | None = None
    logprobs: int | None = None  # None: off; N: the chosen token plus the top N

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 and self.mirostat == 0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class EngineRequest:
    """What the engine runs: a prompt's tokens, sampling, limits, the KV session and scope,
    media, and the next turn's tokens."""

    prompt: list[int]
    sampling: SamplingParams = GREEDY
    max_tokens: int | None = None  # None: until EOG or the context is full
    stop: tuple[str, ...] = ()
    session: SessionId | None = None
    # Whose request this is (an API key's hash; "" without keys): KV cells are reused
    # only between requests of one scope, so no key can probe another's prompts.
    scope: str = ""
    ignore_eos: bool = False
    # Control tokens rendered as text (tool-call and reasoning markers the parser needs);
    # every other control token is left out of the output.
    preserve: frozenset[int] = frozenset()
    # Log-probabilities of the prompt's tokens (each given those before it), in `Done`:
    # the whole prompt is computed (no KV reuse), with sampling.logprobs top entries.
    prompt_logprobs: bool = False
    # LoRA scales, one per adapter the engine loaded (None: their load-time scales).
    # Sequences of different scales never share a decode step (llama.cpp sets adapters
    # per context), nor KV cells.
    lora: tuple[float, ...] | None = None
    # The images whose placeholders are in `prompt` (barrel.engine.projector).
    media: tuple[Media, ...] = ()
    # What the chat template puts after this answer before the next user's words (its
    # end of turn and the user header), as tokens: once the answer ends, the engine
    # decodes them into the parked sequence while it has nothing else to do, and the
    # follow-up turn prefills only its own words (NextTurns.decode, barrel.engine.turns).
    next_turn: tuple[int, ...] = ()


class FinishReason(StrEnum):
    """Why a sequence ended."""

    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Delta:
    """New output of one sequence in one step. `text` is whole UTF-8 characters with
    stop-string candidates held back; `tokens` are the ids sampled this step."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Timings:
    """Where one request's time went, in seconds."""

    queued_s: float
    prefill_s: float
    decode_s: float
    time_to_first_token_s: float

    def prefill_tps(self, n: int) -> float:
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    def decode_tps(self, n: int) -> float:
        return n / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Done:
    """The last event of a request: why it ended, its usage and timings, and every token it
    generated."""

    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    stop_sequence: str | None = None
    tokens: tuple[int, ...] = field(default=())  # every generated token, in order
    # with EngineRequest.prompt_logprobs: one per prompt token but the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def answer(self) -> tuple[int, ...]:
        """The generated tokens as part of the sequence: without the end-of-generation
        token that ended them (it never is)."""
        if self.finish_reason is FinishReason.STOP and self.stop_sequence is None and self.tokens:
            return self.tokens[:-1]
        return self.tokens


Event = Delta | Done
