"""Draft verification: the tokens each generating sequence guesses ahead (prompt-lookup
n-grams, barrel.engine.speculate, or a draft model, barrel.engine.draft), checked in the
same step as its pending token, and which of them it keeps. Owns the draft model and the
choice between them; engine thread."""

from __future__ import annotations

import itertools
import logging

from barrel.engine.deliver import Delivery
from barrel.engine.draft import DraftModel, Want
from barrel.engine.errors import InvalidGrammar
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.engine.projector import is_placeholder
from barrel.engine.run import Run
from barrel.engine.shared import Shared
from barrel.engine.speculate import NgramDrafter

logger = logging.getLogger(__name__)


class Verifier:
    """Owns speculative decoding's plan and check: draft tokens for generating sequences,
    and how many of them a step's logits accept."""

    def __init__(self, shared: Shared, delivery: Delivery) -> None:
        model, options, n_ctx = shared.model, shared.options, shared.n_ctx
        self.options, self.n_ctx, self.kv = options, n_ctx, shared.kv
        self.delivery, self.observer = delivery, shared.observer
        # partial KV removal (rejected drafts) needs a plain attention cache
        plain = not (model.swa or model.recurrent)
        self.fast_forward = plain  # a grammar's forced tokens, decoded as a draft
        self.forced_tokens = 0  # tokens appended that way
        self.ngrams = options.speculation == "ngram" and options.draft_max > 0 and plain
        self.drafter: DraftModel | None = None
        if options.draft_model is not None and plain and not options.embedding:
            draft = LlamaModel.load(options.draft_model, ModelOptions(model.options.n_gpu_layers))
            try:
                self.drafter = DraftModel(draft, model, options, n_ctx)
            except BaseException:
                draft.free()
                raise
            self.ngrams = False  # the draft model drafts instead
            logger.info("engine %s: drafting with %s", shared.name, options.draft_model.name)

    def plan(self, generating: list[Run], room: int, speculate: bool = True) -> list[Run]:
        """Give each generating sequence its draft, in order, while the batch has `room`
        for its pending token and the draft; returns those that fit. Without
        `speculate` only a grammar's forced tokens: a step that reads prompt rows takes
        no guesses, whose rows (a few each, over a whole context) go through the
        row-by-row attention kernel and delay every prompt's first token in the step
        (a 15-token draft beside a 1,200-token prompt: 0.5 s a step on 2 cores)."""
        guesses = self._guesses(generating) if speculate else {}
        planned: list[Run] = []
        for run in generating:
            if room <= 0:
                break
            assert run.slot is not None
            room -= 1
            run.draft = self.forced(run, room)
            run.forced = bool(run.draft)
            if run.forced or not speculate:
                pass
            elif self.drafter is not None:
                run.draft = guesses.get(run.slot.seq, [])[:room]
            else:
                run.draft = self.draft(run, room)
            room -= len(run.draft)
            planned.append(run)
        return planned

    def _room(self, run: Run, room: int) -> int:
        """Draft tokens `run` can verify: within `room`, the context and its token limit."""
        room = min(room, self.n_ctx - max(run.n_past, len(run.req.prompt)) - 2)
        if run.req.max_tokens is not None:
            room = min(room, run.req.max_tokens - len(run.generated) - 1)
        return max(room, 0)

    def _guesses(self, generating: list[Run]) -> dict[int, list[int]]:
        """The draft model's tokens for the generating sequences (none with images: the
        draft model cannot read them), by sequence id."""
        if self.drafter is None:
            return {}
        k = self.options.draft_model_tokens
        wants = [
            Want(run.slot.seq, [*run.req.prompt, *run.generated], self._room(run, k))
            for run in generating
            if run.slot is not None and not run.req.media
        ]
        return self.drafter.draft(wants, k)

    def forced(self, run: Run, room: int) -> list[int]:
        """The tokens `run`'s grammar allows as the only continuation after its pending
        token (llguidance's fast-forward), within `room`: decoded in this step and
        taken without sampling. Not with logprobs (forced rows compute no logits)."""
        constraint = run.sampler.constraint
        if constraint is None or not self.fast_forward or run.req.sampling.logprobs is not None:
            return []
        try:
            return constraint.forced()[: self._room(run, room)]
        except InvalidGrammar:
            return []  # the sampler meets the same error and ends the run

    def draft(self, run: Run, room: int) -> list[int]:
        """N-gram draft tokens to verify after `run`'s pending token, within the batch's
        `room`, the context and the request's token limit."""
        if not self.ngrams:
            return []
        history = len(run.req.prompt) + len(run.generated)
        if run.drafter is None:
            opts = self.options
            run.drafter = NgramDrafter(
                [*run.req.prompt, *run.generated], opts.draft_ngram, opts.draft_max
            )
        elif len(run.drafter.history) < history:
            run.drafter.extend(run.generated[len(run.drafter.history) - history :])
        draft = run.drafter.draft(self._room(run, room))
        if run.req.media:  # never an image's placeholder
            draft = list(itertools.takewhile(lambda t: not is_placeholder(t), draft))
        return draft

    def verify(self, run: Run, index: int, seq: int) -> None:
        """Keep the draft tokens while each equals the token sampled before it (the
        token at `index + j` was sampled from the logits of draft token j-1), then drop
        the rejected ones' KV cells. A forced draft is taken whole (`take_forced`)."""
        if run.forced:
            self.take_forced(run, index, seq)
            return
        draft, run.draft = run.draft, []
        kept = 0
        for j, token in enumerate(draft):
            if run.slot is None or run.pending != token:
                break
            self.kv.placed(run.slot, [token])  # already decoded at this position
            run.n_past += 1
            run.pending = None
            kept += 1
            self.delivery.sample(run, index + 1 + j)
        self.kv.cut(seq, run.n_past)
        if run.drafter is not None:
            run.drafter.record(len(draft), kept)
        self.observer.drafted(len(draft), kept)

    def take_forced(self, run: Run, index: int, seq: int) -> None:
        """Append the grammar's forced tokens decoded at rows `index + 1...` (the run's
        pending token was at `index`), then sample from the last one's row."""
        draft, run.draft, run.forced = run.draft, [], False
        taken = 0
        for token in draft:
            self.delivery.force(run, token)
            if run.slot is None or run.pending != token:
                break  # the run ended (max_tokens, a stop string, the grammar's end)
            self.kv.placed(run.slot, [token])  # already decoded at this position
            run.n_past += 1
            run.pending = None
            taken += 1
        else:
            self.delivery.sample(run, index + len(draft))
        self.kv.cut(seq, run.n_past)
        self.forced_tokens += taken
        self.observer.forced(taken)

    def free(self) -> None:
        if self.drafter is not None:
            self.drafter.free()
            self.drafter = None
