"""One request's state inside the engine thread, and its text pipeline."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from barrel.engine.kvcache import Slot
from barrel.engine.model import LlamaModel
from barrel.engine.sampler import Sampler
from barrel.engine.speculate import NgramDrafter
from barrel.engine.stream import Stream
from barrel.engine.text import StopMatcher, Utf8Stream
from barrel.engine.types import Delta, Done, EngineRequest, Event, FinishReason, RequestId, Timings
from barrel.values import TokenLogprob, Usage


@dataclass
class Run:
    """One request's progress in the engine: its slot, what of its prompt is in the KV, its
    sampler, the token to decode next and the events for its stream."""

    id: RequestId
    req: EngineRequest
    stream: Stream
    sampler: Sampler
    submitted: float = field(default_factory=time.monotonic)
    slot: Slot | None = None
    n_past: int = 0  # tokens of this sequence in the KV
    pending: int | None = None  # sampled, not yet decoded
    generated: list[int] = field(default_factory=list)
    reused: int = 0
    reuse_note: str = ""
    cancelled: bool = False
    admitted: float = 0.0
    prefill_done: float = 0.0
    last_token_at: float = 0.0
    out: list[Event | BaseException] = field(default_factory=list)
    # prompt logprobs: collected during prefill, and this step's (batch index, position)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    logit_rows: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: the sequence's n-gram index, and this step's draft tokens
    # (in the batch right after the pending token)
    drafter: NgramDrafter | None = None
    draft: list[int] = field(default_factory=list)
    # the draft is the grammar's forced tokens (fast-forward): taken, not sampled, and
    # only its last row's logits are computed
    forced: bool = False
    _utf8: Utf8Stream = field(default_factory=Utf8Stream)
    _stops: StopMatcher | None = None

    def __post_init__(self) -> None:
        if self.req.stop:
            self._stops = StopMatcher(self.req.stop)

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.req.prompt)

    def advance(self, n_tokens: int) -> list[int]:
        """The run's `n_tokens` rows of a step are decoded: the tokens its slot now holds
        after what it held (the slot manager records them: SlotManager.placed)."""
        assert self.slot is not None
        if self.prefilling:
            start = self.n_past
            placed = self.req.prompt[start : start + n_tokens]
            self.n_past += n_tokens
            if not self.prefilling:
                self.prefill_done = time.monotonic()
            return placed
        assert self.pending is not None
        placed = [self.pending]
        self.n_past += 1
        self.pending = None
        return placed

    def add_token(
        self, model: LlamaModel, token: int, logprob: TokenLogprob | None
    ) -> tuple[bool, str | None]:
        """Record a sampled token and emit its text. Returns (end of generation,
        the stop string matched)."""
        self.generated.append(token)
        lps = (logprob,) if logprob is not None else ()
        if model.is_eog(token) and not self.req.ignore_eos:
            self.out.append(Delta("", (token,), lps))
            return True, None
        text = self._utf8.feed(model.piece(token, special=token in self.req.preserve))
        stop = None
        if self._stops is not None:
            text, stop = self._stops.feed(text)
        self.out.append(Delta(text, (token,), lps))
        return False, stop

    def finish(self, reason: FinishReason, stop: str | None = None) -> Done:
        """Flush held-back text and append the final `Done`."""
        tail = self._utf8.flush()
        if stop is None and reason is not FinishReason.CANCELLED:
            if self._stops is not None:
                tail, late = self._stops.feed(tail)
                if late is None:
                    tail += self._stops.flush()
                stop = late
            if tail:
                self.out.append(Delta(tail, ()))
        now = time.monotonic()
        admitted = self.admitted or now
        n_prompt = len(self.req.prompt)
        usage = Usage(
            prompt_tokens=n_prompt,
            completion_tokens=len(self.generated),
            prompt_reused=self.reused,
            prompt_computed=(min(self.n_past, n_prompt) - self.reused) if self.admitted else 0,
            reuse_note=self.reuse_note,
        )
        prefilled = self.prefill_done > 0
        timings = Timings(
            queued_s=admitted - self.submitted,
            prefill_s=max(0.0, (self.prefill_done or now) - admitted),
            decode_s=max(0.0, now - self.prefill_done) if prefilled else 0.0,
            time_to_first_token_s=(self.prefill_done - self.submitted) if prefilled else 0.0,
        )
        done = Done(
            reason, usage, timings, stop, tuple(self.generated), tuple(self.prompt_logprobs)
        )
        self.out.append(done)
        return done
