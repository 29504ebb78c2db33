"""Delivery from the engine thread to asyncio.

Each request has a `Stream`, read with `async for` on its event loop. The engine
collects every sequence's events of one step and hands them to each loop with a single
`ToLoop.post` (one wake-up per step, not per token).

Slow readers: a stream counts events emitted (engine thread) and consumed (loop thread);
each counter has one writer. When a reader falls `high_water` events behind, the engine
pauses that sequence: it is left out of the next steps, so its backlog stops growing while
every other sequence goes on. The reader resumes it by catching up below `high_water / 2`.
Memory stays bounded and no reader can stall the batch.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

from barrel.engine.types import Delta, Done, Event, RequestId
from barrel.futures import ToLoop

HIGH_WATER = 256


class Stream:
    """One request's events from the engine thread to the event loop: bounded, paused when
    the reader falls behind, cancelled when the reader leaves."""

    def __init__(
        self,
        request_id: RequestId,
        loop: ToLoop,
        cancel: Callable[[RequestId], None],
        resume: Callable[[], None],
        high_water: int = HIGH_WATER,
    ) -> None:
        self.id = request_id
        self.loop = loop
        self.high_water = high_water
        self._cancel = cancel
        self._resume = resume
        self._items: deque[Event | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._finished = False  # loop thread: Done or an error was read
        self.emitted = 0  # written by the engine thread only
        self.consumed = 0  # written by the loop thread only
        self.paused = False  # written by the engine thread; read by the loop thread

    # -- engine side (engine thread) ---------------------------------------------

    @property
    def backlog(self) -> int:
        return self.emitted - self.consumed

    # -- loop side ---------------------------------------------------------------------

    def _push(self, items: list[Event | BaseException]) -> None:
        self._items.extend(items)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        self.consumed += 1
        if self.paused and self.backlog <= self.high_water // 2:
            self._resume()
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if isinstance(item, Done):
            self._finished = True
        return item

    async def collect(self) -> tuple[list[Delta], Done]:
        """Read the whole stream: every delta, then the final `Done`."""
        deltas: list[Delta] = []
        async for event in self:
            if isinstance(event, Done):
                return deltas, event
            deltas.append(event)
        raise RuntimeError("stream ended without Done")

    def cancel(self) -> None:
        """Stop generating. The stream ends with `Done(finish_reason=cancelled)`."""
        if not self._finished:
            self._cancel(self.id)

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.cancel()


def deliver(batch: list[tuple[Stream, list[Event | BaseException]]]) -> None:
    """Runs on the loop: one call for all the streams of one step."""
    for stream, items in batch:
        stream._push(items)
