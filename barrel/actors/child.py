"""The base class of every supervised actor, and the link to its supervisor.

Pykka differs from OTP in two ways this module covers:

* `on_start` raising stops the actor without calling `on_failure`: here `init()` runs in
  `on_start` and its outcome resolves `Link.started`, which the supervisor waits on, so a
  failed `init()` is a failed start.
* an exception inside an `ask` is handed to the caller and the actor lives on: here calls
  are `bridge.Call` messages handled in `on_receive`, where only `BarrelError` (an
  expected, typed failure) goes back to the caller alone. Any other exception is a bug:
  the caller still gets it, and the actor crashes ("let it crash": the call came as a
  `tell`, whose failure pykka turns into `on_failure`), so its supervisor restarts it from
  a clean state. Calls still queued when the actor ends are answered `Unavailable`.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import pykka

from barrel.actors.bridge import IN_FLIGHT, Call, dead_letter
from barrel.errors import BarrelError

logger = logging.getLogger(__name__)

ExitKind = Literal["normal", "crash"]


@dataclass(frozen=True)
class Exit:
    """Why a child's thread ended."""

    kind: ExitKind
    error: BaseException | None = None

    @property
    def abnormal(self) -> bool:
        return self.kind != "normal"

    def __str__(self) -> str:
        if self.error is None:
            return self.kind
        return f"{self.kind}: {type(self.error).__name__}: {self.error}"


NORMAL = Exit("normal")

ExitHook = Callable[[str, Exit], None]
"""Called from the child's own thread with (actor urn, reason) when it ends."""


@dataclass
class Link:
    """What a supervisor hands each child incarnation when it starts it."""

    id: str
    on_exit: ExitHook
    started: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


class Child(pykka.ThreadingActor):
    """A supervised Pykka actor.

    Subclasses override `init()` (runs in the actor's thread, before any message) and
    `terminate(reason)` (runs in the actor's thread when it ends, normally or not), not
    `on_start`/`on_stop`/`on_failure`. Keep both short: slow work belongs in a message.
    """

    # A child stuck past its shutdown timeout is abandoned; it must not keep the process.
    use_daemon_thread = True

    def __init__(self, link: Link) -> None:
        super().__init__()
        self.link = link
        self._exited = False

    # -- hooks for subclasses -------------------------------------------------

    def init(self) -> None:
        """Set the actor up. Raising here is a failed start."""

    def terminate(self, reason: Exit) -> None:
        """Release resources. Runs once, whatever ended the actor."""

    def ping(self) -> str:
        """Answer from the actor's own thread: proof that it is processing messages."""
        return self.link.id

    # -- pykka plumbing ---------------------------------------------------------

    def on_start(self) -> None:
        try:
            self.init()
        except BaseException as exc:
            self.link.started.set_exception(exc)
            raise
        self.link.started.set_result(None)

    def on_stop(self) -> None:
        self._exit(NORMAL)

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exit(Exit("crash", exception_value))

    def on_receive(self, message: Any) -> Any:
        """Subclasses handle their own messages and pass the rest here."""
        if isinstance(message, Call):
            self._answer(message)
            return None
        return super().on_receive(message)

    def _answer(self, call: Call) -> None:
        IN_FLIGHT.take(self.actor_urn, call)
        answer = call.answer
        try:
            result = getattr(self, call.method)(*call.args, **call.kwargs)
        except BarrelError as exc:
            # Expected and typed: the caller handles it; the actor lives on.
            if answer is not None:
                answer.reject(exc)
            return
        except Exception as exc:
            # A bug: the caller hears it, and the actor crashes rather than go on in
            # whatever state the bug left it.
            if answer is not None:
                answer.reject(exc)
            raise
        if answer is not None:
            answer.resolve(result)

    def _drain_calls(self) -> None:
        """Answer the calls still queued: their callers would wait for their timeout.
        (Those are known from bridge.IN_FLIGHT; pykka's inbox is its own business.)"""
        for call in IN_FLIGHT.left(self.actor_urn):
            dead_letter(call, f"{type(self).__name__}.{call.method}")

    def _exit(self, reason: Exit) -> None:
        if self._exited:
            return
        self._exited = True
        self._drain_calls()
        try:
            self.terminate(reason)
        except Exception:
            logger.exception("%s failed in terminate()", self)
        try:
            self.link.on_exit(self.actor_urn, reason)
        except Exception:
            logger.exception("%s could not report its exit", self)
