"""Delivery: what a step's rows mean to each request, and getting it to the readers.
Samples a sequence's next token (or its prompt's logprobs), decides whether it ends,
collects each run's events and sends them, one wake-up per event loop a step, to the
streams (barrel.engine.stream). Owns the runs with events this step; engine thread."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from barrel.engine import stream as streams
from barrel.engine.errors import InvalidGrammar
from barrel.engine.roster import Roster
from barrel.engine.run import Run
from barrel.engine.sampler import LogitRows
from barrel.engine.shared import Shared
from barrel.engine.stream import Stream
from barrel.engine.turns import NextTurns
from barrel.engine.types import Event, FinishReason, RequestId
from barrel.futures import ToLoop
from barrel.values import TokenLogprob


class Delivery:
    """Owns what a decoded step brings each run: sampled tokens, logprobs, kept logits,
    finishes and failures, batched into one wake-up of the event loop per step (`flush`)."""

    def __init__(self, shared: Shared, rows: LogitRows, roster: Roster, turns: NextTurns) -> None:
        self.ctx, self.model, self.options = shared.ctx, shared.model, shared.options
        self.n_ctx, self.observer, self.kv = shared.n_ctx, shared.observer, shared.kv
        self.rows, self.roster, self.turns = rows, roster, turns
        self._dirty: dict[RequestId, Run] = {}  # runs with events to deliver this step

    def decoded(
        self,
        entries: list[tuple[Run, int, int]],
        verify: Callable[[Run, int, int], None] | None,
    ) -> None:
        """What a decoded step's entries (run, batch row or -1, tokens) bring: prompt
        logprobs, the prompt's progress, a sampled token and the drafts it verifies."""
        for run, index, n_tokens in entries:
            if run.logit_rows:
                self.prompt_logprobs(run)
            prefilled = run.prefilling
            assert run.slot is not None
            self.kv.placed(run.slot, run.advance(n_tokens))
            if index >= 0 and run.req.max_tokens == 0:
                self.finish(run, FinishReason.LENGTH)  # the prompt only (its logprobs)
            elif index >= 0:
                if prefilled:
                    self.keep_logits(run, index)
                seq = run.slot.seq if run.slot is not None else -1
                if not run.forced:  # a forced draft is taken, not sampled (Verifier)
                    self.sample(run, index)
                if run.draft:
                    assert verify is not None
                    verify(run, index, seq)

    def sample(self, run: Run, index: int, logits: np.ndarray | None = None) -> None:
        """Sample `run`'s next token from batch row `index`, or from kept `logits`."""
        started = time.monotonic()
        try:
            if logits is None:
                token = run.sampler.sample(self.ctx, index)
            else:
                token = run.sampler.sample_from(logits)
        except InvalidGrammar as exc:  # llguidance's limits, or no token allowed
            self.fail(run, exc)
            return
        now = time.monotonic()
        budget = self.options.grammar_sample_s
        if run.req.sampling.grammar and budget and now - started > budget:
            # A grammar this slow would stall every other sequence of the batch: end it.
            self.fail(
                run,
                InvalidGrammar(
                    f"sampling under this grammar took {now - started:.1f}s a token; "
                    f"at most {budget:g}s"
                ),
            )
            return
        logprob = None
        if run.req.sampling.logprobs is not None and logits is not None:
            logprob = run.sampler.logprobs_from(logits, token)
        elif run.req.sampling.logprobs is not None:
            logprob = run.sampler.logprobs(self.ctx, index, token)
        self._add(run, token, logprob, now)

    def force(self, run: Run, token: int) -> None:
        """Append `token`, the only one `run`'s grammar allows here (its fast-forward),
        without sampling it."""
        constraint = run.sampler.constraint
        assert constraint is not None
        try:
            constraint.take(token)
        except InvalidGrammar as exc:
            self.fail(run, exc)
            return
        self._add(run, token, None, time.monotonic())

    def _add(self, run: Run, token: int, logprob: TokenLogprob | None, now: float) -> None:
        if run.generated:
            self.observer.inter_token(now - run.last_token_at)
        else:
            self.observer.first_token(now - run.submitted)
        run.last_token_at = now
        end, stop = run.add_token(self.model, token, logprob)
        self._dirty[run.id] = run
        constraint = run.sampler.constraint
        if end or stop is not None or (constraint is not None and constraint.stopped):
            self.finish(run, FinishReason.STOP, stop)
        elif (
            run.req.max_tokens is not None and len(run.generated) >= run.req.max_tokens
        ) or run.n_past + 1 >= self.n_ctx:
            self.finish(run, FinishReason.LENGTH)
        else:
            run.pending = token

    def prompt_logprobs(self, run: Run) -> None:
        """The logprob of each prompt token given those before it, from this step's rows."""
        prompt = run.req.prompt
        for i, pos in run.logit_rows:
            run.prompt_logprobs.append(run.sampler.logprobs(self.ctx, i, prompt[pos + 1]))
        run.logit_rows.clear()

    def keep_logits(self, run: Run, index: int) -> None:
        """Keep the logits of the prompt's last token with the slot (a copy: the
        context's buffer is reused by the next decode)."""
        if run.slot is not None and not run.req.prompt_logprobs:
            row = self.rows(self.ctx, index)
            run.slot.prompt_logits = (tuple(run.req.prompt), row.copy())

    def finish(self, run: Run, reason: FinishReason, stop: str | None = None) -> None:
        done = run.finish(reason, stop)
        self._dirty[run.id] = run
        self.observer.finished(done)
        if reason is not FinishReason.CANCELLED and stop is None:
            self.turns.queue(run)
        self.roster.release(run)

    def fail(self, run: Run, error: BaseException) -> None:
        """End `run` with `error`, its sequence parked."""
        self.out(run, error)
        self.roster.release(run)

    def out(self, run: Run, item: Event | BaseException) -> None:
        run.out.append(item)
        self._dirty[run.id] = run

    def flush(self) -> None:
        """One wake-up per event loop, carrying every sequence's events of this step."""
        runs = list(self._dirty.values())
        self._dirty.clear()
        by_loop: dict[ToLoop, list[tuple[Stream, list[Event | BaseException]]]] = {}
        for run in runs:
            if not run.out:
                continue
            items, run.out = run.out, []
            run.stream.emitted += len(items)
            if run.stream.backlog > run.stream.high_water:
                run.stream.paused = True
            by_loop.setdefault(run.stream.loop, []).append((run.stream, items))
        for to_loop, batch in by_loop.items():
            to_loop.post(streams.deliver, batch)  # a closed loop: its readers are gone
