"""Calling an actor's method: from the event loop without blocking it, or from another
actor's thread, always with a timeout.

A call is a `Call` message sent with pykka's public `tell`; the actor (a `Child`) runs the
method in its own thread and settles the answer it carries: a `Reply` posted to the
caller's loop (`call`), or a thread future (`call_sync`). `await pykka_future` would block
the loop (pykka issue #99) and parking a pool thread on `.get()` wastes a thread per call,
so neither is used. Every call has a timeout and raises `CallTimeout` naming the target
when it expires; a late answer is dropped. A call to an actor that is gone, or that stops
with the call still queued, raises `Unavailable`: every call is noted in `IN_FLIGHT`
until the actor takes it up, so an actor that stops answers those it leaves (`Child`)
without reading pykka's inbox.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pykka

from barrel.errors import CallTimeout, Unavailable
from barrel.futures import Reply

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0  # OTP's gen_server:call default


class Answer(Protocol):
    """Where a call's outcome goes; settled once, from the actor's thread."""

    def resolve(self, value: Any) -> None: ...

    def reject(self, exc: BaseException) -> None: ...


@dataclass(frozen=True)
class Call:
    """Run `method(*args, **kwargs)` on the actor and settle `answer` with the outcome."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    answer: Answer | None = None


class _ThreadAnswer:
    """The answer of a call made from a thread that may block (another actor's)."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def resolve(self, value: Any) -> None:
        try:
            self.future.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass

    def reject(self, exc: BaseException) -> None:
        try:
            self.future.set_exception(exc)
        except concurrent.futures.InvalidStateError:
            pass


class InFlight:
    """The calls sent to each actor (by its urn) and not yet taken up. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, dict[int, Call]] = {}

    def add(self, urn: str, call: Call) -> None:
        with self._lock:
            self._calls.setdefault(urn, {})[id(call)] = call

    def take(self, urn: str, call: Call) -> None:
        """The actor took `call` up (or it was never delivered)."""
        with self._lock:
            calls = self._calls.get(urn)
            if calls is not None:
                calls.pop(id(call), None)
                if not calls:
                    del self._calls[urn]

    def left(self, urn: str) -> list[Call]:
        """The calls an actor that stops leaves unanswered; forgotten here."""
        with self._lock:
            return list(self._calls.pop(urn, {}).values())

    def __len__(self) -> int:
        with self._lock:
            return sum(len(c) for c in self._calls.values())


IN_FLIGHT = InFlight()


def _what(ref: pykka.ActorRef[Any], method: Callable[..., Any]) -> str:
    return f"{ref.actor_class.__name__}.{method.__name__}"


def _send(ref: pykka.ActorRef[Any], call: Call, what: str) -> None:
    IN_FLIGHT.add(ref.actor_urn, call)
    try:
        ref.tell(call)
    except pykka.ActorDeadError:
        IN_FLIGHT.take(ref.actor_urn, call)
        raise Unavailable(f"{what} is not running", retry_after=1.0) from None


async def call(
    ref: pykka.ActorRef[Any],
    method: Callable[..., T],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> T:
    """Call `method` (an attribute of the actor's class, e.g. `Catalog.lookup`) on the
    actor behind `ref`, in the actor's thread, and await its result on the loop."""
    what = _what(ref, method)
    reply: Reply[T] = Reply()
    _send(ref, Call(method.__name__, args, kwargs, reply), what)
    try:
        return await reply.wait(timeout)
    except TimeoutError:
        raise CallTimeout(f"{what} did not answer within {timeout}s") from None


def call_sync(
    ref: pykka.ActorRef[Any],
    method: Callable[..., T],
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> T:
    """The same from a thread that may block (an actor calling another, a test). Never
    from the event loop."""
    what = _what(ref, method)
    answer = _ThreadAnswer()
    _send(ref, Call(method.__name__, args, kwargs, answer), what)
    try:
        result: T = answer.future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise CallTimeout(f"{what} did not answer within {timeout}s") from None
    return result


def dead_letter(message: Any, what: str) -> None:
    """A call left to an actor that stopped: its caller hears so now."""
    if isinstance(message, Call) and message.answer is not None:
        message.answer.reject(Unavailable(f"{what} stopped before answering", retry_after=1.0))
