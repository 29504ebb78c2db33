"""Per-model FIFO admission queues (one actor holds them all).

Each model admits requests while their engine sequences fit its `concurrency` (its
engine's sequence count; a request weighs as many sequences as it runs, at most all of
them, so one many-choice request cannot starve the queue);
up to `depth` more wait in arrival order; beyond that a request is refused at once with
503 and Retry-After. A waiting request learns its position as it changes and is told
when it is admitted, through the thread-safe `notify` it brings (a `ToLoop.wrap`); one
that gives up (client gone, timeout) leaves the queue. Grants are never lost: a release
admits the next waiter in the same message.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from barrel.actors.child import Child, Link
from barrel.errors import Unavailable

Notify = Callable[[int], None]  # position (0 = admitted); safe to call from any thread


class QueueFull(Unavailable):
    code = "queue_full"


@dataclass(frozen=True)
class QueueLimits:
    concurrency: int = 4
    depth: int = 16


@dataclass
class _Waiter:
    ticket: int
    notify: Notify
    weight: int = 1


@dataclass
class _Queue:
    limits: QueueLimits
    running: dict[int, int] = field(default_factory=dict)  # ticket -> weight
    waiting: deque[_Waiter] = field(default_factory=deque)

    def fits(self, weight: int) -> bool:
        used = sum(self.running.values())
        return not self.running or used + weight <= self.limits.concurrency


class ModelQueues(Child):
    def __init__(self, link: Link, default: QueueLimits | None = None) -> None:
        super().__init__(link)
        self.default = default or QueueLimits()
        self._queues: dict[str, _Queue] = {}
        self._tickets = itertools.count(1)

    def configure(self, model: str, limits: QueueLimits) -> None:
        """Set a model's limits (the loader does, from its sequence count)."""
        q = self._queues.setdefault(model, _Queue(limits))
        q.limits = limits
        self._grant(q)

    def enqueue(
        self,
        model: str,
        notify: Notify,
        limits: QueueLimits | None = None,
        weight: int = 1,
    ) -> tuple[int, int]:
        """Returns (ticket, position): position 0 means admitted now. `limits` (the
        model's, as `configure` sets them) come with the request: one message, not two.
        `weight`: the sequences the request runs."""
        if limits is not None:
            self.configure(model, limits)
        q = self._queues.setdefault(model, _Queue(self.default))
        ticket = next(self._tickets)
        weight = max(1, min(weight, q.limits.concurrency))
        if not q.waiting and q.fits(weight):
            q.running[ticket] = weight
            return ticket, 0
        if len(q.waiting) >= q.limits.depth:
            raise QueueFull(
                f"model {model} is busy: {len(q.running)} running, {len(q.waiting)} waiting",
                retry_after=2.0,
            )
        q.waiting.append(_Waiter(ticket, notify, weight))
        return ticket, len(q.waiting)

    def release(self, model: str, ticket: int) -> None:
        """A request ends (or gives up while waiting): free its place."""
        q = self._queues.get(model)
        if q is None:
            return
        if ticket in q.running:
            del q.running[ticket]
        else:
            before = len(q.waiting)
            q.waiting = deque(w for w in q.waiting if w.ticket != ticket)
            if len(q.waiting) == before:
                return
        self._grant(q)

    def status(self, model: str) -> tuple[int, int]:
        """(running, waiting)."""
        q = self._queues.get(model)
        return (len(q.running), len(q.waiting)) if q else (0, 0)

    def _grant(self, q: _Queue) -> None:
        while q.waiting and q.fits(q.waiting[0].weight):
            w = q.waiting.popleft()
            q.running[w.ticket] = w.weight
            w.notify(0)
        for i, w in enumerate(q.waiting, start=1):
            w.notify(i)
