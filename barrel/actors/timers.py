"""Timers for actors: send-after and periodic ticks, over an injectable clock.

Actors never sleep to wait for time to pass: they ask `Timers` to tell them a message
later. With `SystemClock` one daemon thread fires due timers; with `ManualClock` (tests)
nothing fires until the test calls `advance()`, which fires due timers synchronously in
the test's thread, so time-dependent behaviour is tested without sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import pykka

logger = logging.getLogger(__name__)

COMPACT_AT = 64  # timers in the heap before the cancelled ones are dropped


class Clock(Protocol):
    def monotonic(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to. Thread-safe."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self._timers: list[Timers] = []

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            timers = list(self._timers)
        for t in timers:
            t.fire_due()

    def attach(self, timers: Timers) -> None:
        with self._lock:
            self._timers.append(timers)


@dataclass(order=True)
class Timer:
    due: float
    seq: int
    ref: pykka.ActorRef[Any] = field(compare=False)
    message: Any = field(compare=False)
    interval: float | None = field(compare=False, default=None)
    cancelled: bool = field(compare=False, default=False)

    def cancel(self) -> None:
        """Cancel: the message is not sent again (one already sent stays in the inbox)."""
        self.cancelled = True


class Timers:
    """A heap of pending timers. Thread-safe; `send_after`/`interval` may be called
    from any thread, usually from an actor scheduling a message to itself."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._heap: list[Timer] = []
        self._compact_at = COMPACT_AT
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if isinstance(self.clock, ManualClock):
            self.clock.attach(self)
        else:
            self._thread = threading.Thread(target=self._run, name="barrel-timers", daemon=True)
            self._thread.start()

    def send_after(self, delay: float, ref: pykka.ActorRef[Any], message: Any) -> Timer:
        """Tell `message` to `ref` once, `delay` seconds from now."""
        return self._add(Timer(self.clock.monotonic() + delay, next(self._seq), ref, message))

    def interval(self, period: float, ref: pykka.ActorRef[Any], message: Any) -> Timer:
        """Tell `message` to `ref` every `period` seconds until cancelled or `ref` dies."""
        if period <= 0:
            raise ValueError("period must be positive")
        now = self.clock.monotonic()
        return self._add(Timer(now + period, next(self._seq), ref, message, interval=period))

    def pending(self) -> int:
        with self._cond:
            return sum(1 for t in self._heap if not t.cancelled)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def fire_due(self) -> None:
        """Send every message whose time has come. Called by the driver thread or by
        `ManualClock.advance`."""
        now = self.clock.monotonic()
        due: list[Timer] = []
        with self._cond:
            while self._heap and self._heap[0].due <= now:
                t = heapq.heappop(self._heap)
                if t.cancelled:
                    continue
                due.append(t)
                if t.interval is not None:
                    # Re-arm from the scheduled time, not from now, so ticks do not drift;
                    # a tick that is already late by whole periods is skipped, not replayed.
                    t.due += t.interval * max(1, int((now - t.due) // t.interval) + 1)
                    heapq.heappush(self._heap, t)
        for t in due:
            try:
                t.ref.tell(t.message)
            except pykka.ActorDeadError:
                t.cancel()

    def _add(self, timer: Timer) -> Timer:
        with self._cond:
            if self._stopped:
                raise RuntimeError("timers are stopped")
            if len(self._heap) >= self._compact_at:
                # cancelled timers wait for their due time in the heap: drop them once
                # they could be half of it (a keep-alive re-armed on every request)
                self._heap = [t for t in self._heap if not t.cancelled]
                heapq.heapify(self._heap)
                self._compact_at = max(COMPACT_AT, 2 * len(self._heap))
            heapq.heappush(self._heap, timer)
            self._cond.notify_all()
        return timer

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                wait = None
                if self._heap:
                    wait = max(0.0, self._heap[0].due - self.clock.monotonic())
                if wait is None or wait > 0:
                    self._cond.wait(timeout=wait if wait is not None else 60.0)
                    continue
            try:
                self.fire_due()
            except Exception:  # the driver must survive anything a tell raises
                logger.exception("timer driver")
