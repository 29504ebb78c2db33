"""Which llama.cpp sequence a request runs on, and what of its prompt is already there.

A finished sequence stays parked with its tokens. A new request runs on a free sequence
it continues (its own session's first, and only within its scope: with API keys, one
key's tokens are never reused for another), drops the rest of that sequence's KV and
prefills only the remainder. A request that continues none runs on an empty sequence
(else the least recently used parked one, whose state goes to the state cache first) and
shares the longest prefix any other sequence holds: with a unified KV cache,
llama_memory_seq_cp tags the same cells, so a regenerated answer, a second user of the
same system prompt or a code edit asked again costs nothing, and no parked conversation
is cut for a few common tokens. Parked sequences pushed out of the context go to the
state cache and come back on a prefix match. With a KV stream per sequence
(`EngineOptions.kv_per_sequence`) a shared prefix is a copy of the source sequence's
state, made at once and cut to the prefix, and parked sequences stay: they hold their
own stream and cost no other sequence anything. Engine thread only.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import llama_cpp as ll
import numpy as np

from barrel.engine.kvcache import Slot, common_prefix
from barrel.engine.kvdisk import BLOCK, Saved
from barrel.engine.model import LlamaModel
from barrel.engine.states import SavedStates

logger = logging.getLogger(__name__)

# A sequence cut by at least this many tokens for another request is saved to the state
# cache first (a session's sequence always is).
SAVE_MIN_TOKENS = 32
# Parked sequences cost every decode step: a unified KV cache attends up to its highest
# used cell, masked or not (Qwen 0.5B on 2 cores, 3,600 parked cells: a one-token step
# 4 % slower, an eight-token step 7 %; more with longer contexts). Past this many parked
# cells, and more than the running sequences hold, the least recently used parked
# sequences move to the state cache while others run.
PARKED_MAX_CELLS = 1024


def runs_of(ids: set[int]) -> int:
    """Runs of consecutive sequence ids: the micro-batches llama.cpp splits a step over
    these sequences into when each has a KV stream of its own."""
    return sum(1 for i in ids if i - 1 not in ids)


class SlotManager:
    """Owns the KV cells and each sequence's token list: which sequence a request runs on,
    what of its prompt is there already, saves and restores (barrel.engine.states), and
    every llama_memory_* call."""

    def __init__(
        self,
        ctx: Any,
        model: LlamaModel,
        n_seq: int,
        n_pins: int,
        states: SavedStates,
        *,
        per_sequence: bool = False,
    ) -> None:
        self.ctx = ctx
        self.states = states  # sequences saved out of the context (RAM and disk)
        self.per_sequence = per_sequence  # a KV stream of its own for each sequence
        self.mem = ll.llama_get_memory(ctx)
        self.model = model
        self.slots = [Slot(i) for i in range(n_seq)]
        self.pins = [Slot(n_seq + i, pinned=True) for i in range(n_pins)]
        # Whether sequences may share each other's prefixes (partial copies and removals
        # hold for this model's memory).
        self._shares = not (model.swa or model.recurrent)

    def free_slots(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    def kv_cells(self) -> int:
        return sum(len(s.tokens) for s in self.slots + self.pins)

    def busy_cells(self) -> int:
        """Cells of the sequences running now (parked ones and pins give way on demand)."""
        return sum(len(s.tokens) for s in self.slots if s.busy)

    def pin_slot(self, tokens: list[int], scope: str = "") -> Slot | None:
        """The pin sequence to (re)fill with `tokens`: None if one already holds them.
        The least recently used pin is replaced."""
        if not self.pins:
            return None
        for pin in self.pins:
            if pin.tokens == tokens and pin.scope == scope:
                pin.touch()
                return None
        victim = min(self.pins, key=lambda s: (s.busy, s.last_used))
        if victim.busy:
            return None
        ll.llama_memory_seq_rm(self.mem, victim.seq, -1, -1)
        victim.tokens = []
        victim.scope = scope
        victim.busy = True
        return victim

    def choose(
        self, prompt: list[int], session: str | None, scope: str = ""
    ) -> tuple[Slot, int] | None:
        """The free slot to run `prompt` on and its common prefix, or None if all are busy.
        Another scope's tokens count as no prefix at all."""
        found = self._choose(prompt, session, scope)
        if found is None or not self.per_sequence:
            return found
        return self._beside_running(*found)

    def _beside_running(self, slot: Slot, lcp: int) -> tuple[Slot, int]:
        """With a stream per sequence llama.cpp decodes a step in one micro-batch for each
        run of consecutive sequence ids, and each reads all the weights again (sequences
        0 and 2 running cost two one-token steps, not one two-token step). A request whose
        slot would start a run of its own moves to a free slot that joins one: that
        slot's parked sequence goes to the state cache (an empty slot first; none that
        holds one without a cache), and what the chosen slot holds is copied along
        (`_copy_now`) and leaves it."""
        running = {s.seq for s in self.slots if s.busy}

        def runs(seq: int) -> int:
            return runs_of(running | {seq})

        others = [
            s for s in self.free_slots() if s is not slot and (not s.tokens or self.states.can_save)
        ]
        if not running or not others:
            return slot, lcp
        to = min(others, key=lambda s: (runs(s.seq), bool(s.tokens), s.last_used))
        if runs(to.seq) >= runs(slot.seq):
            return slot, lcp
        if to.tokens:
            self.save(to)
            self._drop(to)
        if lcp > 0:
            if not self._copy_now(slot, to):
                return slot, lcp
            to.tokens, to.session, to.scope = list(slot.tokens), slot.session, slot.scope
            to.prompt_logits = slot.prompt_logits
            self._drop(slot)
        return to, lcp

    def close_gap(self) -> tuple[Slot, Slot] | None:
        """With a stream per sequence, a sequence that finishes between running ones
        splits every later step into two micro-batches, each reading all the weights
        (see `_beside_running`), until a request fills the gap. Moves one running
        sequence into a free slot that joins the runs, its cells copied along
        (`_copy_now`): into an empty slot if one will do, else into the least recently
        used parked one, whose sequence goes to the state cache first (none without a
        cache); of the sequences that could move, the one with the fewest tokens.
        Returns (from, to), or None when no such move exists or a copy failed (then
        nothing changed, but a parked sequence may have gone to the cache)."""
        if not self.per_sequence:
            return None
        busy = [s for s in self.slots if s.busy]
        running = {s.seq for s in busy}
        now = runs_of(running)
        if now <= 1:
            return None
        free = [s for s in self.free_slots() if not s.tokens or self.states.can_save]
        best: tuple[tuple[int, bool, float, int], Slot, Slot] | None = None
        for src in busy:
            for dst in free:
                runs = runs_of((running - {src.seq}) | {dst.seq})
                key = (runs, bool(dst.tokens), dst.last_used, len(src.tokens))
                if runs < now and (best is None or key < best[0]):
                    best = (key, src, dst)
        if best is None:
            return None
        _, src, dst = best
        if dst.tokens:
            if not self.save(dst):
                return None
            self._drop(dst)
        if not self._copy_now(src, dst):
            return None
        dst.tokens, dst.session, dst.scope = src.tokens, src.session, src.scope
        dst.prompt_logits = src.prompt_logits
        dst.busy = True
        dst.touch()
        self._drop(src)
        src.busy = False
        return src, dst

    def _choose(
        self, prompt: list[int], session: str | None, scope: str
    ) -> tuple[Slot, int] | None:
        free = self.free_slots()
        if not free:
            return None

        def lcp(s: Slot) -> int:
            return common_prefix(s.tokens, prompt) if s.scope == scope else 0

        def score(s: Slot) -> tuple[int, int, float]:
            # longest common prefix, then empty over parked, then least recently used
            return (lcp(s), 0 if s.tokens else 1, -s.last_used)

        own = [s for s in free if session is not None and s.session == session]
        if own:
            best = max(own, key=score)
            if lcp(best) > 0:
                return best, lcp(best)
        if not self._shares:
            best = max(free, key=score)
            return best, lcp(best)
        # A sequence this prompt continues: it keeps at least half of what the sequence
        # holds, or the whole prompt is there (the same question asked again).
        goes_on = [
            s
            for s in free
            if s.tokens
            and lcp(s) > 0
            and (2 * lcp(s) >= len(s.tokens) or lcp(s) >= len(prompt) - 1)
        ]
        if goes_on:
            best = max(goes_on, key=score)
            return best, lcp(best)
        # Otherwise where the least is lost; attach shares the longest prefix held anywhere.
        target = min(free, key=lambda s: (bool(s.tokens), s.last_used))
        return target, lcp(target)

    def attach(
        self,
        slot: Slot,
        prompt: list[int],
        lcp: int,
        session: str | None,
        *,
        reuse: bool = True,
        scope: str = "",
    ) -> tuple[int, str]:
        """Prepare `slot` for `prompt`: returns (tokens reused, a note if reuse fell short).
        Without `reuse` every prompt token is computed again (for its logits). At least
        one prompt token is decoded, for the first sample's logits, unless the slot kept
        the logits this very prompt left (`prompt_logits`), or a state restored from the
        cache brought them: then all of `prompt` is reused."""
        whole = reuse and self.prompt_logits(slot, prompt, lcp) is not None
        keep = min(lcp, len(prompt) - (0 if whole else 1)) if reuse else 0
        if len(slot.tokens) - keep >= SAVE_MIN_TOKENS or (
            keep < len(slot.tokens) and slot.session is not None
        ):
            self.save(slot)
        if reuse:
            # the longest prefix held: another sequence's cells, else a saved state
            shared = self._source(slot, prompt, keep, scope)
            restored = self._restore(slot, prompt, shared[0] if shared else keep, scope)
            if restored:
                # a state restored with the logits this very prompt left keeps it whole
                whole = self.prompt_logits(slot, prompt, restored) is not None
                keep = min(restored, len(prompt) - (0 if whole else 1))
            elif shared:
                keep = min(self._share(slot, *shared), len(prompt) - 1)
        keep, note = self._trim(slot, keep)
        slot.busy = True
        slot.session = session
        slot.scope = scope
        slot.touch()
        return keep, note

    @staticmethod
    def prompt_logits(slot: Slot, prompt: list[int], lcp: int) -> np.ndarray | None:
        """The logits `slot` kept after prefilling exactly `prompt`, if it still holds
        all of it (`lcp`: what of `prompt` it holds)."""
        kept = slot.prompt_logits
        if kept is None or lcp < len(prompt) or len(kept[0]) != len(prompt):
            return None
        return kept[1] if kept[0] == tuple(prompt) else None

    def placed(self, slot: Slot, tokens: Sequence[int]) -> None:
        """A decode put `tokens` into `slot`'s sequence, after what it held: the slot's
        token list follows its cells (this room is the only one that edits it)."""
        slot.tokens.extend(tokens)

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.touch()

    def cut(self, seq: int, start: int) -> None:
        """Remove sequence `seq`'s cells from position `start` on: cells a step decoded
        that the sequence does not keep (rejected drafts, an image that found no room,
        an idle decode given up). Its tokens list stays with the caller."""
        ll.llama_memory_seq_rm(self.mem, seq, start, -1)

    def truncate(self, slot: Slot, keep: int) -> None:
        """Keep only the slot's first `keep` tokens, cells and list alike."""
        self.cut(slot.seq, keep)
        del slot.tokens[keep:]

    def unpin(self, slot: Slot) -> None:
        """A pinned prefix that could not be prefilled: its sequence emptied and free."""
        self.cut(slot.seq, -1)
        slot.busy = False
        slot.tokens = []

    def evict_lru(self) -> bool:
        """Free the KV cells of the least recently used parked sequence (saving its state)."""
        parked = [s for s in self.slots if not s.busy and s.tokens]
        if not parked:
            return False
        if self.per_sequence:
            return False  # a full stream is the sequence's own: no other's cells help
        victim = min(parked, key=lambda s: s.last_used)
        self.save(victim)
        self._drop(victim)
        return True

    def shed_parked(self, running: int, taking: Slot | None = None) -> int:
        """Move least recently used parked sequences to the state cache while parked cells
        exceed PARKED_MAX_CELLS and `running`, the cells the running sequences are to
        hold; only those the cache takes leave the KV, and never `taking` (the slot a
        request is being attached to). Returns how many moved."""
        moved = 0
        while running and not self.per_sequence:
            parked = [s for s in self.slots if not s.busy and s.tokens and s is not taking]
            if sum(len(s.tokens) for s in parked) <= max(PARKED_MAX_CELLS, running):
                break
            victim = min(parked, key=lambda s: s.last_used)
            if not self.save(victim):
                break
            self._drop(victim)
            moved += 1
        return moved

    def _drop(self, slot: Slot) -> None:
        ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        slot.tokens = []
        slot.session = None
        slot.prompt_logits = None

    def evict_pin(self) -> bool:
        """Free the least recently used idle pinned prefix: a pin is only a cache, and a
        running request that needs its cells comes first."""
        idle = [p for p in self.pins if not p.busy and p.tokens]
        if not idle or self.per_sequence:
            return False
        victim = min(idle, key=lambda p: p.last_used)
        ll.llama_memory_seq_rm(self.mem, victim.seq, -1, -1)
        victim.tokens = []
        return True

    def clear_all(self) -> None:
        ll.llama_memory_clear(self.mem, True)
        for s in self.slots:
            s.tokens = []
            s.session = None
            s.prompt_logits = None

    def _trim(self, slot: Slot, keep: int) -> tuple[int, str]:
        """Drop the slot's KV past `keep`; fall back to a full recompute if the model's
        memory refuses a partial removal (sliding-window or recurrent models)."""
        if keep >= len(slot.tokens):
            del slot.tokens[keep:]
            return keep, ""
        ok = bool(ll.llama_memory_seq_rm(self.mem, slot.seq, keep, -1))
        if ok and keep > 0 and (self.model.swa or self.model.recurrent):
            # A sliding-window cache keeps only the last n_swa positions: what is left
            # must still reach position keep-1 and start early enough for the window.
            # (For iSWA memories pos_max is the lower of the two caches' maxima.)
            pos_min = ll.llama_memory_seq_pos_min(self.mem, slot.seq)
            pos_max = ll.llama_memory_seq_pos_max(self.mem, slot.seq)
            ok = pos_max == keep - 1 and 0 <= pos_min <= max(0, keep - self.model.n_swa)
        note = ""
        if not ok:
            ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            if keep > 0:
                note = (
                    f"{keep} cached prompt tokens could not be reused: the model's memory "
                    "refused a partial removal (sliding-window or recurrent model)"
                )
            keep = 0
        del slot.tokens[keep:]
        return keep, note

    def save(self, slot: Slot) -> bool:
        """Put the slot's state in the state cache; False if it did not take it."""
        if not self.states.can_save or not slot.tokens:
            return False
        data = self._state_of(slot, self.states.cache.ram_bytes)
        if data is None:
            return False
        tokens = list(slot.tokens)
        return self.states.save(tokens, slot.session, data, slot.scope, slot.prompt_logits)

    def _state_of(self, slot: Slot, limit: int | None = None) -> bytes | None:
        """The slot's sequence state (llama_state_seq_get_data), None if empty, failed or
        larger than `limit`."""
        size = ll.llama_state_seq_get_size(self.ctx, slot.seq)
        if size <= 0 or (limit is not None and size > limit):
            return None
        buf = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data(self.ctx, buf, size, slot.seq)
        return ctypes.string_at(buf, n) if n > 0 else None

    def _source(
        self, slot: Slot, prompt: list[int], keep: int, scope: str
    ) -> tuple[int, Slot] | None:
        """The pinned prefix or other sequence (parked or running) holding the longest
        prefix of `prompt`, if longer than `keep`. Sequences are sources only for models
        whose memory takes partial copies (not sliding-window or recurrent ones)."""
        sources = [p for p in self.pins if not p.busy]
        if self._shares:
            sources += [s for s in self.slots if s is not slot]
        best: tuple[int, Slot] | None = None
        for src in sources:
            if not src.tokens or src.scope != scope:
                continue
            n = common_prefix(src.tokens, prompt)
            if n > keep and (best is None or n > best[0]):
                best = (n, src)
        return best

    def _share(self, slot: Slot, n: int, src: Slot) -> int:
        """Give `slot` the first `n` cells of `src`. With a unified KV cache,
        llama_memory_seq_cp tags the same cells with the slot's sequence: nothing is
        recomputed or copied. Between streams the sequence's state is copied at once and
        cut to `n` (see `_copy_now`)."""
        ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        if self.per_sequence:
            if not self._copy_now(src, slot):
                slot.tokens = []
                return 0
            ll.llama_memory_seq_rm(self.mem, slot.seq, n, -1)
        else:
            ll.llama_memory_seq_cp(self.mem, src.seq, slot.seq, 0, n)
        slot.tokens = list(src.tokens[:n])
        src.touch()
        return n

    def _copy_now(self, src: Slot, slot: Slot) -> bool:
        """Copy `src`'s sequence into `slot`'s stream now, through its saved state.
        llama_memory_seq_cp between streams only queues a copy of the whole stream buffer
        for the next decode: a state restored into the source stream, or saved from the
        destination, before then would be copied or saved wrong (a restore in the same
        admission pass gave another session the restored conversation's cells)."""
        data = self._state_of(src)
        return data is not None and self._load(slot, data)

    def _load(self, slot: Slot, data: bytes) -> bool:
        """Put a saved sequence state into `slot`'s sequence (its cells emptied first);
        False, and the sequence left empty, if llama.cpp refuses it."""
        ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if ll.llama_state_seq_set_data(self.ctx, buf, len(data), slot.seq) == 0:
            ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            return False
        return True

    def held(self, prompt: list[int], scope: str) -> int:
        """The longest prefix of `prompt` a sequence or pinned prefix of `scope` holds."""
        held = [common_prefix(s.tokens, prompt) for s in self.slots + self.pins if s.scope == scope]
        return max(held, default=0)

    def _restore(self, slot: Slot, prompt: list[int], keep: int, scope: str) -> int:
        """Load the longest saved state of `prompt` longer than `keep` into `slot` (from
        RAM, or read from disk beforehand: SavedStates.ready); returns the prefix of
        `prompt` it holds (0: none)."""
        found = self.states.best(prompt, keep, scope)
        if found is None:
            return 0
        data = self.states.take(found)
        if data is None:
            return 0
        if not self._load(slot, data):
            self.states.refused(found)
            self._drop(slot)
            return 0
        self.states.restored(found, prompt)
        slot.tokens = list(found.tokens)
        slot.prompt_logits = found.logits
        return found.n

    def states_to_save(self) -> list[Saved]:
        """What the context and the state cache hold, to write to disk as the engine
        stops: every sequence and pinned prefix of at least a block of tokens, and the
        cache's entries."""
        out = []
        for slot in self.slots + self.pins:
            if len(slot.tokens) >= BLOCK:
                data = self._state_of(slot)
                if data is not None:
                    out.append(Saved(slot.scope, tuple(slot.tokens), data))
        out += [st for st in self.states.entries() if len(st.tokens) >= BLOCK]
        return out
