"""Admission: a waiting request takes a slot (the one holding most of its prompt), its
reusable prefix is attached by the slot manager, and a prompt already whole in the KV
with its logits gets its first token without a decode. Images too: a prompt's image
placeholders are checked at submission, and each image a prefilling sequence reaches is
evaluated by the projector into the sequence. Engine thread, but `check_media`."""

from __future__ import annotations

import time

import numpy as np

from barrel.engine.deliver import Delivery
from barrel.engine.errors import KVCacheFull
from barrel.engine.kvcache import Slot
from barrel.engine.lora import Loras, Scales
from barrel.engine.projector import Projector, is_placeholder
from barrel.engine.roster import Roster
from barrel.engine.run import Run
from barrel.engine.shared import Shared
from barrel.engine.types import EngineRequest, FinishReason
from barrel.errors import InvalidRequest


def check_media(req: EngineRequest, projector: Projector | None) -> None:
    """A prompt's image placeholders must all be images this request brought, and
    never end it (the first sample needs a text token's logits). Any thread."""
    holes = {t for t in req.prompt if is_placeholder(t)}
    if not holes and not req.media:
        return
    if projector is None:
        raise InvalidRequest("this model reads text only; images and audio are not supported")
    if holes - {m.token for m in req.media}:
        raise InvalidRequest("the prompt has token ids outside the vocabulary")
    if is_placeholder(req.prompt[-1]):
        raise InvalidRequest("a prompt may not end with an image")
    if req.prompt_logprobs:
        raise InvalidRequest("prompt logprobs are not available for prompts with images")


class Admission:
    """Owns the step's admission: waiting requests take sequences (the slot manager attaches
    their reusable prefix), a prompt already whole in the KV gets its first token without a
    decode, and images and audio windows are evaluated into their sequences."""

    def __init__(
        self,
        shared: Shared,
        roster: Roster,
        delivery: Delivery,
        loras: Loras,
        projector: Projector | None,
    ) -> None:
        self.ctx, self.kv, self.n_batch = shared.ctx, shared.kv, shared.options.n_batch
        self.roster, self.delivery = roster, delivery
        self.loras, self.projector = loras, projector

    def admit(self) -> None:
        """Waiting requests take slots, in arrival order, while one is free."""
        waiting = self.roster.waiting
        while waiting:
            run = waiting[0]
            reuse = not run.req.prompt_logprobs
            if reuse and self.kv.free_slots() and not self._restorable(run):
                break  # its saved state is being read (not here): the others go on
            choice = self.kv.choose(run.req.prompt, run.req.session, run.req.scope)
            if choice is None:
                break
            waiting.popleft()
            slot, lcp = choice
            run.admitted = time.monotonic()
            # Parked sequences leave before this one's cells are placed: a state restored
            # from the cache then lands in the cells they held, low in the KV, not above
            # them (every step attends up to the highest used cell), and a restore that
            # needs more contiguous cells than they left free still succeeds.
            running = self.roster.running_cells()
            self.kv.shed_parked(running + len(run.req.prompt), taking=slot)
            run.n_past, run.reuse_note = self.kv.attach(
                slot,
                run.req.prompt,
                lcp,
                run.req.session,
                reuse=reuse,
                scope=run.req.scope,
            )
            self._image_start(run, slot)
            # the whole prompt reused with the logits its prefill left (attach)
            logits = self.kv.prompt_logits(slot, run.req.prompt, run.n_past) if reuse else None
            run.reused = run.n_past
            run.slot = slot
            self.roster.active.append(run)
            if logits is not None and not run.prefilling:
                self._first_from_kept(run, logits)
        self.delivery.flush()

    def _restorable(self, run: Run) -> bool:
        """Whether every saved state `run` could restore is at hand: False while a disk
        state holding more of its prompt than the context does is read, off this thread
        (barrel.engine.states); the reader wakes the engine when it is done."""
        prompt, scope = run.req.prompt, run.req.scope
        return self.kv.states.ready(prompt, scope, self.kv.held(prompt, scope))

    def _first_from_kept(self, run: Run, logits: np.ndarray) -> None:
        """The prompt is whole in the slot with the logits that followed it: the first
        token comes from them, without a decode, and is the token a cold run samples."""
        run.prefill_done = time.monotonic()
        if run.req.max_tokens == 0:
            self.delivery.finish(run, FinishReason.LENGTH)
        else:
            self.delivery.sample(run, -1, logits)

    def _image_start(self, run: Run, slot: Slot) -> None:
        """KV reuse that ends inside an image goes back to the image's start: an image
        is evaluated whole."""
        prompt, n = run.req.prompt, run.n_past
        if n == 0 or n >= len(prompt) or not is_placeholder(prompt[n]):
            return
        start = n
        while start > 0 and prompt[start - 1] == prompt[n]:
            start -= 1
        if start < n:
            self.kv.truncate(slot, start)
            run.n_past = start

    def media(self, lora: Scales) -> None:
        """Evaluate the image or audio window each prefilling sequence has reached (the
        projector decodes its embeddings into the sequence). No KV room: parked
        sequences go first, then the request fails, as for tokens."""
        if self.projector is None:
            return
        for run in list(self.roster.active):
            if not run.prefilling or run.slot is None or self.loras.of(run) != lora:
                continue
            token = run.req.prompt[run.n_past]
            if not is_placeholder(token):
                continue
            media = next(m for m in run.req.media if m.token == token)
            n_pos = 0
            seq = run.slot.seq
            while True:
                try:
                    n_pos = self.projector.evaluate(self.ctx, media, run.n_past, seq, self.n_batch)
                    break
                except RuntimeError:
                    self.kv.cut(seq, run.n_past)
                    if not (self.kv.evict_lru() or self.kv.evict_pin()):
                        self.delivery.fail(
                            run, KVCacheFull("no KV room for the image", retry_after=1.0)
                        )
                        break
            if run.slot is not None:
                self.kv.placed(run.slot, [token] * n_pos)
                run.n_past += n_pos
