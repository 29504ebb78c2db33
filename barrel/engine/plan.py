"""Batch planning: what one step decodes. Each generating sequence's pending token and
its draft (barrel.engine.verify), then chunks of the prompts being prefilled, in the
order they came (or the one with the fewest rows left first), as many rows as the
prefill budget allows beside generating sequences (more while prompts outnumber them),
a grammar's forced start right after a prompt's last token, then pinned prefixes; with a
KV stream per sequence, every sequence's rows in sequence order (one micro-batch takes a
row of each, not two split at a prompt's id) and running sequences moved to close a gap
between their ids. Owns the batch's contents, the rate prompt rows cost lately and the
pinned prefixes' rows of this step; engine thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from barrel.engine.admit import Admission
from barrel.engine.inbox import PinJob
from barrel.engine.lora import Loras
from barrel.engine.projector import is_placeholder
from barrel.engine.roster import Roster, runnable
from barrel.engine.run import Run
from barrel.engine.shared import Shared
from barrel.engine.slots import runs_of
from barrel.engine.speculate import align_drafts
from barrel.engine.verify import Verifier

logger = logging.getLogger(__name__)

# Prompt tokens per step for a request that wants their logprobs (each one's logits are
# a vocabulary of floats: 64 x 152k x 4 bytes = 39 MB of output buffer for Qwen).
PROMPT_LOGPROB_CHUNK = 64

# (run, batch index of its logits or -1, tokens it put in the batch)
StepPart = tuple[Run, int, int]


@dataclass
class Step:
    """What one filled batch holds, for the engine to decode and then hand on: each
    request's part, and the rows of pinned prefixes being written (job, rows)."""

    parts: list[StepPart] = field(default_factory=list)
    prefixes: list[tuple[PinJob, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.parts or self.prefixes)


# Steps a gap between running sequences (a KV stream each) is left for a new request to
# fill before a running sequence moves into it (`SlotManager.close_gap`): a request that
# comes goes there at no cost, and the move copies a sequence's cells.
GAP_STEPS = 2
GAP_RETRY_STEPS = 64  # after a gap could not be closed

# A step that reads a prompt's last rows takes other prompts' rows only whole and up to
# this many rows in all (`Planner._in_order`): few rows cost little beyond the step's
# pass over the weights, so prompts that come together still share their first step.
FINISH_ROWS = 128

# A prompt's rows in a step go through ggml's CPU flash attention in tiles of this many
# query rows; fewer (a prompt's last few rows, a draft) take its row-by-row kernel, whose
# cost a row grows with the cells attended: 20 ms a row at 1,024 cells against 6 ms in
# tiles (Qwen2.5-Coder-0.5B, 2 cores), so a 30-row tail after 1,170 rows cost 0.5 s of
# its prompt's first token (bench/NOTEBOOK.md). No chunk leaves fewer for later,
# and with a KV stream per sequence one row more (TAIL_ROWS): beside generating
# sequences llama.cpp's equal split puts a chunk's first row in their micro-batch, so a
# tail of 64 rows read beside them was 1 + 63 rows, 1.5 s where a tile reads in 0.46 s.
TILE_ROWS = 64
TAIL_ROWS = TILE_ROWS + 1

# Steps with fewer prompt rows do not time a prompt row (`Planner.budget`): a step of a
# few rows costs a pass over the weights, whatever its rows.
MIN_TIMED_ROWS = 64


def _seq(run: Run) -> int:
    return run.slot.seq if run.slot is not None else -1


class Planner:
    """Owns the filling of each step's batch: one token and drafts per generating sequence,
    prompt chunks within the step's budget, pinned prefixes; returns the `Step` it filled."""

    def __init__(
        self,
        shared: Shared,
        roster: Roster,
        loras: Loras,
        verifier: Verifier,
        admission: Admission,
    ) -> None:
        self.batch, self.kv, self.options = shared.batch, shared.kv, shared.options
        self.name, self.roster, self.loras = shared.name, roster, loras
        self.verifier, self.admission = verifier, admission
        self.prompt_rows = 0  # prompt rows in the batch (fill)
        self.row_s = 0.0  # seconds a row of steps with prompt rows costs lately
        self._gap_steps = 0  # steps the running sequences' ids have not been one run
        self.gap_moves = 0  # running sequences moved to join the others

    def fill(self) -> Step:
        """Fill the batch: one token (and a draft) for each generating sequence, then
        prompt chunks (`shares`), then pinned prefixes."""
        b = self.batch
        b.clear()
        entries: list[StepPart] = []
        active = self.roster.active
        lora = self.loras.for_step(
            (r for r in active if runnable(r)), pinning=bool(self.roster.pinning)
        )
        for run in active:
            run.logit_rows.clear()  # a rebuilt batch (KV full) must not count rows twice
        generating = [
            run
            for run in active
            if not run.prefilling
            and run.pending is not None
            and runnable(run)
            and self.loras.of(run) == lora
        ]
        self.admission.media(lora)
        prefilling = [r for r in active if r.prefilling and self.loras.of(r) == lora]
        # no guesses beside prompt rows (a grammar's forced tokens still go)
        planned = self.verifier.plan(generating, b.capacity, speculate=not prefilling)
        room = b.capacity - len(planned) - sum(len(r.draft) for r in planned)
        if planned:
            waiting = len(prefilling) + len(self.roster.waiting)
            budget = min(room, self.budget(len(planned), waiting))
        else:
            budget = room
        chunks = self.shares(prefilling, budget, room)
        if self.kv.per_sequence and planned:
            chunks += self.fillers(planned, prefilling, chunks, room - sum(t for _, t in chunks))
        budget -= sum(take for _, take in chunks)
        self.prompt_rows = sum(take for _, take in chunks)
        pins: list[tuple[PinJob, int]] = []
        for job in self.roster.pinning:
            if budget <= 0 or lora != self.loras.default:
                break
            take = min(len(job.tokens) - job.n_past, budget)
            pins.append((job, take))
            budget -= take
        if self.kv.per_sequence:
            self.one_ubatch(planned)
        n = len(planned) + sum(len(r.draft) for r in planned) + sum(t for _, t in chunks + pins)
        if not (self.kv.per_sequence and len(planned) > 1):
            align_drafts([r.draft for r in planned], n)
        # rows left for the forced starts of prompts that end in this step
        spare = b.capacity - len(planned) - sum(len(r.draft) for r in planned)
        spare -= sum(t for _, t in chunks + pins)
        # (sequence, who, prompt rows taken: None for a generating sequence's next token)
        rows: list[tuple[int, Run | PinJob, int | None]] = [(_seq(r), r, None) for r in planned]
        rows += [(_seq(r), r, take) for r, take in chunks]
        rows += [(job.slot.seq, job, take) for job, take in pins]
        if self.kv.per_sequence:
            # every sequence's rows in sequence order: llama.cpp's first micro-batch then
            # takes a row of each of them (a prompt's first row between generating
            # sequences' included), not two micro-batches split at the prompt's id
            rows.sort(key=lambda row: row[0])
        for _, who, rows_taken in rows:
            if rows_taken is None:
                assert isinstance(who, Run)
                entries.append(self._add_next(who))
            elif isinstance(who, PinJob):
                for pos in range(who.n_past, who.n_past + rows_taken):
                    b.add(who.tokens[pos], pos, who.slot.seq, False)
            else:
                entries.append(self._add_chunk(who, rows_taken))
                if entries[-1][1] >= 0:
                    spare -= self.force_start(who, spare)
        if not entries and pins:
            # Only pinned prefixes in this batch: llama_decode needs one output somewhere.
            b.raw.logits[b.n - 1] = True
        return Step(entries, pins)

    def _add_next(self, run: Run) -> StepPart:
        """A generating sequence's pending token and its draft."""
        assert run.slot is not None
        assert run.pending is not None
        b = self.batch
        # a forced draft (the grammar's fast-forward) needs its last row's logits only
        run.forced = run.forced and bool(run.draft)
        index = b.add(run.pending, run.n_past, run.slot.seq, not run.forced)
        last = len(run.draft) - 1
        for j, token in enumerate(run.draft):
            b.add(token, run.n_past + 1 + j, run.slot.seq, not run.forced or j == last)
        return run, index, 1

    def _add_chunk(self, run: Run, take: int) -> StepPart:
        """`take` of a prompt's tokens; the entry's index is its last token's row, if
        this chunk reads it."""
        assert run.slot is not None
        prompt, rows = run.req.prompt, run.req.prompt_logprobs
        index = -1
        for pos in range(run.n_past, run.n_past + take):
            last = pos == len(prompt) - 1
            i = self.batch.add(prompt[pos], pos, run.slot.seq, last or rows)
            if rows and not last:
                run.logit_rows.append((i, pos))
            if last:
                index = i
        return run, index, take

    def force_start(self, run: Run, room: int) -> int:
        """The tokens `run`'s grammar forces before its first choice (a schema's
        `{"name": "`, a forced tool call's opening), decoded in the step that reads the
        prompt's last token, right after it: taken as a forced draft (Verifier), so the
        first sampled token comes from this step, one step sooner. Within `room` (the
        rows the step has left); returns the rows added."""
        run.draft, run.forced = [], False
        if run.req.max_tokens == 0 or room <= 0:
            return 0
        assert run.slot is not None
        draft = self.verifier.forced(run, room)
        last = len(draft) - 1
        for j, token in enumerate(draft):
            self.batch.add(token, len(run.req.prompt) + j, run.slot.seq, j == last)
        run.draft, run.forced = draft, bool(draft)
        return len(draft)

    def timed(self, seconds: float) -> None:
        """The batch decoded in `seconds`: a step with enough prompt rows times a row."""
        if self.prompt_rows >= MIN_TIMED_ROWS:
            rate = seconds / self.batch.n
            self.row_s = rate if self.row_s <= 0 else (self.row_s + rate) / 2

    def budget(self, generating: int = 1, waiting: int = 1) -> int:
        """Prompt rows a step takes beside `generating` sequences while `waiting`
        prompts (being prefilled or queued for a slot) wait for their first token:
        `prefill_chunk`, or with `prefill_step_s` as many as take about that long at
        the rate rows of such steps have cost lately (a step's cost per row grows with
        the cells it attends to), never fewer than `prefill_chunk`. A step costs each
        stream a pause and each waiting prompt a delay: with more prompts waiting than
        streams generating, it takes that many times longer (the batch bounds it)."""
        opts = self.options
        if opts.prefill_step_s <= 0 or self.row_s <= 0:
            return opts.prefill_chunk
        seconds = opts.prefill_step_s * max(1.0, waiting / max(1, generating))
        return max(opts.prefill_chunk, int(seconds / self.row_s))

    def shares(
        self, prefilling: list[Run], budget: int, room: int | None = None
    ) -> list[tuple[Run, int]]:
        """The step's prompt rows, `budget` of them, among the prompts being prefilled:
        in the order they were admitted (`_in_order`), or with `prefill_order`
        "shortest" the prompt with the fewest rows left first (its first token comes
        soonest, and the others wait for it least), but the one admitted first (the
        roster keeps arrival order) is sure of a quarter of them, so a long prompt moves
        on while short ones keep coming. A prompt's chunk may go past the budget, within
        `room` (the batch's free rows; the budget without it), to leave no short tail
        (`chunk`)."""
        if not prefilling:
            return []
        room = budget if room is None else room
        if self.options.prefill_order != "shortest":
            return self._in_order(prefilling, budget, room)
        oldest = prefilling[0]
        order = sorted(prefilling, key=lambda r: len(r.req.prompt) - r.n_past)
        held = 0 if order[0] is oldest else max(1, budget // 4)
        left = budget - held
        out: list[tuple[Run, int]] = []
        for run in order:
            if run is oldest:
                left, held = left + held, 0
            take = self.chunk(run, left, room - held) if left > 0 else 0
            if take:
                out.append((run, take))
                left -= take
                room -= take
        return out

    def _in_order(self, prefilling: list[Run], budget: int, room: int) -> list[tuple[Run, int]]:
        """`budget` rows to the prompts in the order they were admitted: the first
        whole before the next. Once a prompt's last rows are in the step, a later one
        joins only whole and within FINISH_ROWS rows in all: its first token comes at
        the step's end, and every row more would delay it by what the row costs (a
        prompt's tail packed with 380 rows of the next one got its first token 1.8 s
        later), while the next prompt loses nothing by starting a step later. A prompt
        whose chunk stops short of its end (a tail left for later, an image, prompt
        logprobs) ends the step's prompt rows too: a later prompt's few rows beside it
        made a micro-batch of as many rows of each (a KV stream per sequence), under a
        tile, and took the row-by-row kernel (40 rows: 1 s)."""
        out: list[tuple[Run, int]] = []
        rows, ended = 0, False
        for run in prefilling:
            left = len(run.req.prompt) - run.n_past
            if ended and (left > budget or rows + left > FINISH_ROWS):
                break
            take = self.chunk(run, budget, room) if budget > 0 else 0
            if take:
                out.append((run, take))
                budget -= take
                room -= take
                rows += take
                ended = ended or take == left
                if take < left:
                    break
        return out

    def close_gap(self) -> None:
        """Join the running sequences' ids into one run (one micro-batch a step) once a
        gap among them has lasted GAP_STEPS steps. Not with a draft model, whose own
        context keeps each sequence under its id. A parked conversation displaced with
        its next turn queued loses only that idle prefill (the entry no longer matches
        the slot); its next turn comes from the state cache."""
        active = self.roster.active
        seqs = {r.slot.seq for r in active if r.slot}
        if self.verifier.drafter is not None or runs_of(seqs) <= 1:
            self._gap_steps = 0
            return
        self._gap_steps += 1
        if self._gap_steps < GAP_STEPS:
            return
        moved = self.kv.close_gap()
        if moved is None:
            self._gap_steps = -GAP_RETRY_STEPS  # no free slot joins them, or a copy failed
            return
        src, dst = moved
        for run in active:
            if run.slot is src:
                run.slot = dst
        self._gap_steps = 0
        self.gap_moves += 1
        logger.debug(
            "engine %s: sequence %d moved to %d, beside the others", self.name, src.seq, dst.seq
        )

    @staticmethod
    def fillers(
        planned: list[Run], prefilling: list[Run], chunks: list[tuple[Run, int]], room: int
    ) -> list[tuple[Run, int]]:
        """With a KV stream per sequence, a row of each prompt not read this step whose
        sequence lies among the generating ones: llama.cpp's micro-batch takes
        consecutive sequence ids, so such a gap split the generating sequences' rows in
        two micro-batches, a pass over the weights more (0.1 s beside seven streams of
        2,000 cells), where the row costs a row. Never one that would leave a short tail,
        nor an image's or prompt logprobs' prompt."""
        seqs = [_seq(r) for r in planned]
        low, high = min(seqs), max(seqs)
        read = {r.id for r, _ in chunks}
        out: list[tuple[Run, int]] = []
        for run in prefilling:
            left = len(run.req.prompt) - run.n_past
            if room <= 0:
                break
            if run.id in read or run.req.media or run.req.prompt_logprobs:
                continue
            if low < _seq(run) < high and left > TAIL_ROWS:
                out.append((run, 1))
                room -= 1
        return out

    @staticmethod
    def one_ubatch(planned: list[Run]) -> None:
        """With a KV stream per sequence llama.cpp splits a step into micro-batches of
        consecutive sequence ids with as many tokens each, and every micro-batch reads
        all the weights again: the step's rows go in sequence order (`fill`), and when
        the generating sequences all draft, with drafts of one length (the shortest:
        one micro-batch); when some do not, only the longest draft stays (one more
        micro-batch, for its tokens)."""
        if len(planned) > 1:
            shortest = min(len(r.draft) for r in planned)
            longest = max(planned, key=lambda r: len(r.draft))
            for run in planned:
                if shortest or run is not longest:
                    del run.draft[shortest:]

    @staticmethod
    def chunk(run: Run, budget: int, room: int | None = None) -> int:
        """How many of `run`'s prompt tokens the step takes: up to `budget`, never past
        an image (evaluated on its own), fewer with prompt logprobs (a vocabulary of
        logits per token: the output buffer stays small). Never a tail of fewer than
        TAIL_ROWS rows left for a later step: the whole prompt if `room` holds it, else
        TAIL_ROWS short of it."""
        prompt = run.req.prompt
        left = len(prompt) - run.n_past
        take = min(left, budget)
        if 0 < left - take < TAIL_ROWS and not run.req.media and not run.req.prompt_logprobs:
            if left <= (budget if room is None else room):
                take = left
            elif left > TAIL_ROWS:  # (a batch of fewer rows than a tile reads as it can)
                take = left - TAIL_ROWS
        if run.req.media:  # text up to the next image (evaluated next step)
            take = next(
                (
                    i - run.n_past
                    for i in range(run.n_past, run.n_past + take)
                    if is_placeholder(prompt[i])
                ),
                take,
            )
        if run.req.prompt_logprobs:
            take = min(take, PROMPT_LOGPROB_CHUNK)
        return take
