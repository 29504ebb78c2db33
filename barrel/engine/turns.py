"""Next-turn prefill: once a conversation's answer ends, the engine decodes what its
template puts before the next user's words (the answer's last token, the end of turn
and the user header) into the parked sequence while it has nothing else to do, so the
follow-up prefills only its own words. Owns the queue of finished conversations and the
idle decode, which gives way to any request queued before or during it (llama.cpp's
abort callback). Engine thread, but `interrupt`, which any thread may set."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import llama_cpp as ll

from barrel.engine.kvcache import Slot
from barrel.engine.lora import Loras
from barrel.engine.run import Run
from barrel.engine.shared import Shared

# How many of a finished conversation's last tokens tell it from another of its length
TURN_TAIL = 32

# llama_decode's status when its abort callback stopped it
ABORTED = 2


class Turn(NamedTuple):
    """A finished conversation's next-turn tokens, to decode into its slot once idle.
    The slot may meanwhile be reused, or take a moved sequence, and end up as long as
    it was: the last tokens it held tell whether it still holds this conversation."""

    slot: Slot
    length: int  # the slot's tokens when the answer ended
    ended: tuple[int, ...]  # the last TURN_TAIL of them
    tokens: list[int]
    when: float  # time.monotonic() from which they may be decoded

    @staticmethod
    def tail(slot: Slot) -> tuple[int, ...]:
        return tuple(slot.tokens[-TURN_TAIL:])

    def holds(self, slot: Slot) -> bool:
        return len(slot.tokens) == self.length and Turn.tail(slot) == self.ended


class NextTurns:
    """Owns the next-turn work: the end of turn and the next user header decoded into parked
    sequences while the engine has nothing else to do."""

    def __init__(self, shared: Shared, loras: Loras, quiet: Callable[[], bool]) -> None:
        self.ctx, self.model, self.options = shared.ctx, shared.model, shared.options
        self.n_ctx, self.batch, self.kv = shared.n_ctx, shared.batch, shared.kv
        self.loras, self.observer = loras, shared.observer
        self._quiet = quiet  # nothing is queued for the engine
        self._turns: deque[Turn] = deque(maxlen=shared.options.n_seq_max)
        self.steps = 0  # idle decodes of next-turn tokens
        self.aborts = 0  # ... given up for a request that came meanwhile
        self.dropped = 0  # ... not decoded: their slot was taken, changed or full
        # Set by any thread that queues work: an idle decode under way stops at its next
        # graph node (the abort callback, armed only for idle decodes).
        self.interrupt = False
        self.abort_check = ll.ggml_abort_callback(lambda _data: self.interrupt)

    def __bool__(self) -> bool:
        return bool(self._turns)

    def wait(self) -> float:
        """Seconds until the newest finished sequence may get its next-turn tokens (how
        long to block for commands meanwhile)."""
        if not self._turns:
            return 1.0
        return max(0.0, min(1.0, self._turns[-1].when - time.monotonic()))

    def due(self) -> bool:
        return bool(self._turns) and self.wait() == 0.0

    def queue(self, run: Run) -> None:
        """Remember what the next turn of this conversation will most likely start with:
        the answer's last token (sampled, never decoded) unless it ended the turn, then
        the template's end of turn and user header."""
        req, slot = run.req, run.slot
        if not req.next_turn or slot is None or not run.generated or req.lora is not None:
            return
        last = run.generated[-1]
        tokens = ([] if self.model.is_eog(last) else [last]) + list(req.next_turn)
        when = time.monotonic() + self.options.next_turn_delay_s
        self._turns.append(Turn(slot, len(slot.tokens), Turn.tail(slot), tokens, when))

    def decode(self) -> None:
        """Idle: decode the finished sequences' next-turn tokens into them, all in one
        step, so that a follow-up prefills only the user's words and the assistant
        header. One step, not one per sequence: after eight streams end together, eight
        small decodes kept both cores busy for most of a second (a follow-up arriving
        meanwhile waited for the one under way, and so did other programs). Only after
        `next_turn_delay_s` of quiet: a client that asks again at once (an agent, a
        benchmark) would otherwise wait for this decode and then prefill its own words
        in a second one, which costs more than one decode of both. A sequence taken or
        changed since is left alone; newest first while the batch has room. The rows go
        in sequence order: with a KV stream per sequence llama.cpp makes a micro-batch
        of each run of increasing, consecutive sequence ids (see `Planner.one_ubatch`),
        and eight sequences in the order they finished cost up to eight passes over the
        weights (half a second of both cores here, which the next request waited for)."""
        turns = list(self._turns)
        self._turns.clear()
        b = self.batch
        b.clear()
        taken: list[Turn] = []
        room = b.capacity
        for turn in reversed(turns):
            slot, tokens = turn.slot, turn.tokens
            if slot.busy or not turn.holds(slot) or turn.length + len(tokens) >= self.n_ctx:
                continue  # taken, changed (a reused or moved slot) or full
            if any(slot is t.slot for t in taken) or len(tokens) > room:
                continue
            taken.append(turn)
            room -= len(tokens)
        if not taken:
            self.dropped += len(turns)
            return
        taken.sort(key=lambda t: t.slot.seq)
        for t in taken:
            for j, token in enumerate(t.tokens):
                b.add(token, t.length + j, t.slot.seq, False)
        b.raw.logits[b.n - 1] = True  # llama_decode wants one output
        self.loras.use(self.loras.default)
        status = self._decode_idle()
        if status != 0:
            for t in taken:
                self.kv.cut(t.slot.seq, t.length)
            if status == ABORTED:  # a request came: try again when idle next time
                self.aborts += 1
                self._turns.extendleft(reversed(turns))
            return
        self.steps += 1
        self.dropped += len(turns) - len(taken)
        for t in taken:
            self.kv.placed(t.slot, t.tokens)
            self.observer.next_turn(len(t.tokens))

    def _decode_idle(self) -> int:
        """`llama_decode` of the batch as idle work: it gives way to work queued before
        or during it (ABORTED at the next node of the graph, a fraction of a
        millisecond, where a request would otherwise wait for the whole decode: up to a
        quarter of a second for eight conversations' turn headers). llama.cpp removes
        the cells of an aborted micro-batch; the caller removes those of the rest.
        The callback takes the GIL at every node, so it is armed for idle decodes only."""
        self.interrupt = False
        if not self._quiet():
            return ABORTED
        ll.llama_set_abort_callback(self.ctx, self.abort_check, None)
        try:
            return int(ll.llama_decode(self.ctx, self.batch.raw))
        finally:
            ll.llama_set_abort_callback(self.ctx, ll.ggml_abort_callback(), None)
