"""Ask an actor from asyncio without blocking the event loop.

`await pykka_future` would call `.get()` and block the loop (pykka issue #99); parking a
thread-pool thread on `.get()` wastes a thread per call. Instead the reply slot of the
message is a `_LoopReply`: when the actor answers, from its own thread, the reply is
handed to the loop with `call_soon_threadsafe`. Every call has a timeout and raises
`CallTimeout` naming the target when it expires; a late answer is dropped.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import pykka
from pykka._envelope import Envelope  # pykka has no public way to attach a custom reply
from pykka.messages import ProxyCall

from barrel.errors import CallTimeout, Unavailable
from barrel.futures import reject, resolve

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0  # OTP's gen_server:call default

ExcInfo = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]


class _LoopReply(pykka.Future[Any]):
    """A pykka reply slot that resolves an asyncio future on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: asyncio.Future[Any]) -> None:
        super().__init__()
        self._loop = loop
        self._target = target

    def get(self, *, timeout: float | None = None) -> Any:
        raise TypeError("a bridged reply is awaited on the event loop, not read with get()")

    def set(self, value: Any | None = None) -> None:
        self._post(resolve, value)

    def set_exception(self, exc_info: ExcInfo | None = None) -> None:
        exc = exc_info[1] if exc_info is not None else sys.exc_info()[1]
        self._post(reject, exc or RuntimeError("actor failed without an exception"))

    def _post(self, fn: Callable[[asyncio.Future[Any], Any], None], arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, self._target, arg)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more


async def ask(
    ref: pykka.ActorRef[Any],
    message: Any,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    what: str | None = None,
) -> Any:
    """Send `message` to `ref` and await its reply, at most `timeout` seconds."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    if not ref.is_alive():
        raise Unavailable(f"{what or ref} is not running", retry_after=1.0)
    ref.actor_inbox.put(Envelope(message, reply_to=_LoopReply(loop, fut)))
    try:
        return await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        raise CallTimeout(f"{what or ref} did not answer within {timeout}s") from None
    except pykka.ActorDeadError:
        raise Unavailable(f"{what or ref} stopped before answering", retry_after=1.0) from None


async def call(
    ref: pykka.ActorRef[Any],
    method: Callable[..., T],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> T:
    """Call `method` (an attribute of the actor's class, e.g. `Catalog.lookup`) on the
    actor behind `ref`, in the actor's thread, and await its result."""
    message = ProxyCall(attr_path=(method.__name__,), args=args, kwargs=kwargs)
    what = f"{ref.actor_class.__name__}.{method.__name__}"
    result: T = await ask(ref, message, timeout=timeout, what=what)
    return result
