"""Who is where in the engine thread: requests waiting for a slot, those holding one
(active), every one by id, and the pinned prefixes being prefilled. Owns a run's end of
tenure: `release` parks its sequence with the slot manager and forgets it."""

from __future__ import annotations

from collections import deque

from barrel.engine.inbox import PinJob
from barrel.engine.run import Run
from barrel.engine.slots import SlotManager
from barrel.engine.types import RequestId


def runnable(run: Run) -> bool:
    """False while the run's reader is too far behind (see barrel.engine.stream)."""
    s = run.stream
    if s.paused and s.backlog <= s.high_water // 2:
        s.paused = False
    return not s.paused


class Roster:
    """Owns who is waiting, active and pinning, and a run's release: the engine thread's
    lists of requests."""

    def __init__(self, kv: SlotManager) -> None:
        self.kv = kv
        self.waiting: deque[Run] = deque()
        self.active: list[Run] = []
        self.runs: dict[RequestId, Run] = {}
        self.pinning: list[PinJob] = []

    def add(self, run: Run) -> None:
        self.runs[run.id] = run
        self.waiting.append(run)

    def release(self, run: Run) -> None:
        """Park the run's sequence for reuse and forget the run."""
        if run.slot is not None:
            self.kv.release(run.slot)
            run.slot = None
        run.sampler.free()
        if run in self.active:
            self.active.remove(run)
        self.runs.pop(run.id, None)

    def pinned(self, rows: list[tuple[PinJob, int]]) -> None:
        """Pinned prefixes' `rows` of a step are in their sequences: a prefix done is
        idle, ready to share."""
        for job, n_tokens in rows:
            self.kv.placed(job.slot, job.tokens[job.n_past : job.n_past + n_tokens])
            job.n_past += n_tokens
            if job.n_past == len(job.tokens):
                self.pinning.remove(job)
                job.slot.busy = False
                job.slot.touch()
                job.reply.resolve(len(job.tokens))

    def fail_pins(self, error: BaseException) -> None:
        for job in self.pinning:
            self.kv.unpin(job.slot)
            job.reply.reject(error)
        self.pinning.clear()

    def running_cells(self) -> int:
        """The cells the active sequences hold or are about to."""
        return sum(len(r.req.prompt) + len(r.generated) for r in self.active)
