"""Speculative decoding with a draft model: a small model of the same vocabulary guesses
the next tokens of every generating sequence, the engine verifies them in its batch.

The draft model has a context of its own, one sequence per engine sequence (the same
ids), and keeps for each the tokens its KV holds. Each step, for the sequences that
generate: the tokens of their history not yet in the draft KV are decoded (all sequences
in one batch; after a rejection the KV is cut back to the common prefix first), then
`k` rounds of one greedy token per sequence, all sequences in one decode per round.
Verification is barrel.engine.verify's (`Verifier.verify`): a draft token is kept while it
equals the token the request's own sampler drew there, so the output is the one the
request would get without drafts, at any temperature.

Engine thread only.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp as ll
import numpy as np

from barrel.engine.context import Batch, EngineOptions, new_context
from barrel.engine.errors import ModelLoadError
from barrel.engine.kvcache import common_prefix
from barrel.engine.model import LlamaModel


@dataclass(frozen=True)
class Want:
    """One sequence's request for a draft: its id, its history (prompt and generated,
    the token to be decoded this step last) and the most tokens it can verify."""

    seq: int
    history: list[int]
    room: int


class DraftModel:
    """A small draft model of the target's vocabulary, with its own context: owns that
    context and proposes draft tokens for the generating sequences."""

    def __init__(
        self, draft: LlamaModel, target: LlamaModel, opts: EngineOptions, n_ctx: int
    ) -> None:
        if draft.n_vocab != target.n_vocab or any(
            draft.piece(t, special=True) != target.piece(t, special=True)
            for t in (0, target.eos, target.n_vocab // 2, target.n_vocab - 1)
            if 0 <= t < target.n_vocab
        ):
            raise ModelLoadError(
                f"the draft model {draft.path.name} does not share the vocabulary of "
                f"{target.path.name}"
            )
        self.model = draft
        self.n_vocab = draft.n_vocab
        self.n_ctx = n_ctx
        self.opts = EngineOptions(
            n_ctx=n_ctx,
            n_batch=opts.n_batch,
            n_ubatch=opts.n_ubatch,
            n_seq_max=opts.n_seq_max,
            max_pins=0,
            threads=opts.threads,
            flash_attn=opts.flash_attn,
        )
        self.ctx: Any = new_context(draft, self.opts, n_ctx)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = Batch(max(self.opts.n_batch, opts.n_seq_max))
        self.held: dict[int, list[int]] = {}  # tokens in the draft KV, by sequence

    def free(self) -> None:
        self.batch.free()
        ll.llama_free(self.ctx)
        self.model.free()

    def draft(self, wants: list[Want], k: int) -> dict[int, list[int]]:
        """Up to min(k, room) greedy tokens for each sequence, by sequence id."""
        wants = [w for w in wants if w.room > 0 and w.history and len(w.history) + k < self.n_ctx]
        if not wants:
            return {}
        self._make_room(wants, k)
        rows = self._catch_up(wants)
        if rows is None:
            return {}
        out: dict[int, list[int]] = {w.seq: [] for w in wants}
        live = list(wants)
        for _ in range(k):
            picks = {w.seq: self._argmax(rows[w.seq]) for w in live}
            for w in live:
                out[w.seq].append(picks[w.seq])
            live = [w for w in live if len(out[w.seq]) < min(k, w.room)]
            if not live:
                break
            b = self.batch
            b.clear()
            rows = {}
            for w in live:
                held = self.held[w.seq]
                rows[w.seq] = b.add(picks[w.seq], len(held), w.seq, True)
                held.append(picks[w.seq])
            if ll.llama_decode(self.ctx, b.raw) != 0:
                self._forget([w.seq for w in live])
                break
        return out

    def _catch_up(self, wants: list[Want]) -> dict[int, int] | None:
        """Decode what each history has beyond the draft KV (cut back to the common
        prefix first); returns each sequence's logits row of its last history token.
        The last tokens go in the last decode, whose logits are the ones read."""
        early: list[tuple[int, int, int]] = []  # (seq, position, token)
        last: list[tuple[int, int, int]] = []
        for w in wants:
            held = self.held.setdefault(w.seq, [])
            keep = min(common_prefix(held, w.history), len(w.history) - 1)
            if keep < len(held):
                ll.llama_memory_seq_rm(self.mem, w.seq, keep, -1)
                del held[keep:]
            early += [(w.seq, pos, w.history[pos]) for pos in range(keep, len(w.history) - 1)]
            last.append((w.seq, len(w.history) - 1, w.history[-1]))
        cap = self.batch.capacity
        chunks = [early[i : i + cap] for i in range(0, len(early), cap)]
        if chunks and len(chunks[-1]) + len(last) <= cap:
            chunks[-1] += last
        else:
            chunks.append(last)
        finals = set(last)
        rows: dict[int, int] = {}
        b = self.batch
        for chunk in chunks:
            b.clear()
            for seq, pos, token in chunk:
                final = (seq, pos, token) in finals
                i = b.add(token, pos, seq, final)
                if final:
                    rows[seq] = i
            if ll.llama_decode(self.ctx, b.raw) != 0:
                self._forget([w.seq for w in wants])
                return None
            for seq, _, token in chunk:
                self.held[seq].append(token)
        return rows

    def _make_room(self, wants: list[Want], k: int) -> None:
        """The draft KV holds every sequence's history in one n_ctx: when these would
        not fit beside the others, the sequences not drafting now are dropped."""
        wanted = {w.seq for w in wants}
        needed = sum(len(w.history) + k for w in wants)
        others = sum(len(held) for seq, held in self.held.items() if seq not in wanted)
        if needed + others >= self.n_ctx:
            self._forget([seq for seq in self.held if seq not in wanted])

    def _argmax(self, row: int) -> int:
        logits = ll.llama_get_logits_ith(self.ctx, row)
        values = np.ctypeslib.as_array(
            ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
        )
        return int(values.argmax())

    def _forget(self, seqs: list[int]) -> None:
        """No KV room (or a failed decode): start these sequences over next time."""
        for seq in seqs:
            ll.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.held[seq] = []
