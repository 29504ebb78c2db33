"""The one way another thread hands something to the event loop.

Actors and engine threads never hold an event loop. What they hold is a `ToLoop` (post a
call onto one loop) or a `Reply` (settle one answer awaited on the loop), both made on the
loop by the code that waits. Every post is a `call_soon_threadsafe`; a post to a closed
loop is dropped (nobody is waiting any more), and settling an answer twice, or one that
was already given up on (a timeout cancelled it), does nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ToLoop:
    """Posts calls onto the loop it was made on. Made on the loop; used from any thread."""

    __slots__ = ("_loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run `fn(*args)` on the loop soon. False when the loop is closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., None]:
        """A callable any thread may call: each call runs `fn` on the loop."""

        def posted(*args: Any) -> None:
            self.post(fn, *args)

        return posted

    def reply(self) -> Reply[Any]:
        return Reply(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToLoop) and other._loop is self._loop

    def __hash__(self) -> int:
        return id(self._loop)


class Reply(Generic[T]):
    """One answer, awaited on the loop and settled from any thread (once)."""

    __slots__ = ("_to", "future")

    def __init__(self, to: ToLoop | None = None) -> None:
        self._to = to or ToLoop()
        self.future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def resolve(self, value: T) -> None:
        self._to.post(_resolve, self.future, value)

    def reject(self, exc: BaseException) -> None:
        self._to.post(_reject, self.future, exc)

    async def wait(self, timeout: float | None) -> T:
        """The answer; TimeoutError after `timeout` seconds (None: the caller bounds it)."""
        if timeout is None:
            return await self.future
        return await asyncio.wait_for(self.future, timeout)


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
