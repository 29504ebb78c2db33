"""An OTP-style supervisor on Pykka.

Mirrors `supervisor.erl`: child specs, the four strategies, restart types, restart
intensity counted as OTP's `add_restart` does, start in order and stop in reverse, and a
failed restart retried by a message the supervisor sends itself (never a blocking loop).

Thread affinity: every method of `Supervisor` runs in the supervisor's own actor thread.
Children report their exit through `Link.on_exit` from *their* thread; that hook only
tells the supervisor a `ChildExited` message, so all bookkeeping stays single-threaded.
Starting a child blocks the supervisor thread up to the child's `start_timeout`; starts
are short by design (slow work happens in response to a message).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import pykka

from barrel.actors.child import Child, Exit, Link
from barrel.actors.registry import Registry
from barrel.actors.timers import Clock, SystemClock
from barrel.errors import BarrelError, InvalidRequest, NotFound

logger = logging.getLogger(__name__)


class Strategy(StrEnum):
    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"
    SIMPLE_ONE_FOR_ONE = "simple_one_for_one"


class Restart(StrEnum):
    PERMANENT = "permanent"  # always restarted
    TRANSIENT = "transient"  # restarted only after an abnormal exit
    TEMPORARY = "temporary"  # never restarted


class ChildType(StrEnum):
    WORKER = "worker"
    SUPERVISOR = "supervisor"


StartFn = Callable[..., "pykka.ActorRef[Any]"]
"""`start(link, *args) -> ActorRef`: start one incarnation of a child (usually a
`Child` subclass's `start` classmethod, with its options bound by `functools.partial`)."""


@dataclass(frozen=True)
class ChildSpec:
    id: str
    start: StartFn
    restart: Restart = Restart.PERMANENT
    shutdown: float = 5.0
    type: ChildType = ChildType.WORKER
    start_timeout: float = 5.0


@dataclass(frozen=True)
class SupFlags:
    strategy: Strategy = Strategy.ONE_FOR_ONE
    intensity: int = 1
    period: float = 5.0


class SupervisorObserver(Protocol):
    def child_restarted(self, child_id: str) -> None: ...


class _NoObserver:
    def child_restarted(self, child_id: str) -> None:
        pass


@dataclass(frozen=True)
class SupervisorEnv:
    """What every supervisor of one tree shares."""

    registry: Registry
    clock: Clock = field(default_factory=SystemClock)
    observer: SupervisorObserver = field(default_factory=_NoObserver)


@dataclass(frozen=True)
class ChildInfo:
    name: str
    type: ChildType
    restart: Restart
    ref: pykka.ActorRef[Any] | None

    @property
    def running(self) -> bool:
        return self.ref is not None


class StartFailed(BarrelError):
    status = 503
    code = "start_failed"

    def __init__(self, name: str, cause: BaseException | str) -> None:
        super().__init__(f"child {name} failed to start: {cause}", retry_after=1.0)
        self.name = name
        self.cause = cause


class RestartIntensityExceeded(Exception):
    """Raised inside a supervisor to crash it: its parent decides what happens next."""


@dataclass(frozen=True)
class ChildExited:
    urn: str
    reason: Exit


@dataclass(frozen=True)
class _TryAgainRestart:
    name: str


@dataclass
class _Slot:
    spec: ChildSpec
    name: str
    args: tuple[Any, ...] = ()
    ref: pykka.ActorRef[Any] | None = None

    @property
    def urn(self) -> str | None:
        return self.ref.actor_urn if self.ref is not None else None


class Supervisor(Child):
    def __init__(
        self,
        link: Link,
        flags: SupFlags,
        children: Sequence[ChildSpec],
        env: SupervisorEnv,
    ) -> None:
        # Validated in the caller's thread so a bad tree fails `start()` at once.
        super().__init__(link)
        ids = [c.id for c in children]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate child ids in {link.id}: {ids}")
        if flags.strategy is Strategy.SIMPLE_ONE_FOR_ONE and len(children) != 1:
            raise ValueError("simple_one_for_one takes exactly one child spec (the template)")
        if flags.intensity < 0 or flags.period <= 0:
            raise ValueError("intensity must be >= 0 and period > 0")
        self.flags = flags
        self.env = env
        self._template = children[0] if self._simple else None
        self._slots: list[_Slot] = [] if self._simple else [_Slot(c, c.id) for c in children]
        self._restarts: list[float] = []  # newest first, like OTP's #state.restarts

    @property
    def _simple(self) -> bool:
        return self.flags.strategy is Strategy.SIMPLE_ONE_FOR_ONE

    # -- lifecycle --------------------------------------------------------------

    def init(self) -> None:
        started: list[_Slot] = []
        for slot in self._slots:
            try:
                self._start_slot(slot)
            except StartFailed:
                self._stop_slots(reversed(started))
                raise
            started.append(slot)

    def terminate(self, reason: Exit) -> None:
        self._stop_slots(reversed(self._slots))

    # -- API (asked by other threads) ----------------------------------------

    def which_children(self) -> list[ChildInfo]:
        return [ChildInfo(s.name, s.spec.type, s.spec.restart, s.ref) for s in self._slots]

    def start_child(self, name: str, *args: Any) -> pykka.ActorRef[Any]:
        """simple_one_for_one: start a new child from the template, registered as `name`."""
        if self._template is None:
            raise InvalidRequest(f"{self.link.id} is not simple_one_for_one")
        if any(s.name == name for s in self._slots):
            raise InvalidRequest(f"{name} is already a child of {self.link.id}")
        slot = _Slot(self._template, name, args)
        self._start_slot(slot)
        self._slots.append(slot)
        assert slot.ref is not None
        return slot.ref

    def terminate_child(self, name: str) -> None:
        """Stop a child. A dynamic child is forgotten; a static one keeps its spec and
        can be started again with `restart_child`."""
        slot = self._find(name)
        self._stop_slots([slot])
        if self._simple:
            self._slots.remove(slot)

    def restart_child(self, name: str) -> pykka.ActorRef[Any]:
        slot = self._find(name)
        if slot.ref is not None:
            raise InvalidRequest(f"{name} is running")
        self._start_slot(slot)
        assert slot.ref is not None
        return slot.ref

    # -- messages -----------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, ChildExited):
            self._child_exited(message)
        elif isinstance(message, _TryAgainRestart):
            slot = next((s for s in self._slots if s.name == message.name), None)
            if slot is not None and slot.ref is None:
                self._restart(slot)
        else:
            super().on_receive(message)

    def _child_exited(self, msg: ChildExited) -> None:
        slot = next((s for s in self._slots if s.urn == msg.urn), None)
        if slot is None:
            return  # an incarnation we stopped ourselves, or already replaced
        slot.ref = None
        restart = slot.spec.restart
        if restart is Restart.TEMPORARY or (
            restart is Restart.TRANSIENT and not msg.reason.abnormal
        ):
            logger.info("%s/%s exited (%s); not restarted", self.link.id, slot.name, msg.reason)
            self.env.registry.unregister(slot.name, str(msg.reason))
            if self._simple or restart is Restart.TEMPORARY:
                self._slots.remove(slot)
            return
        logger.warning("%s/%s exited (%s); restarting", self.link.id, slot.name, msg.reason)
        self.env.registry.mark_down(slot.name, "restarting", str(msg.reason))
        self._restart(slot)

    # -- restarts -----------------------------------------------------------------

    def _add_restart(self) -> bool:
        """OTP's add_restart/1: keep restarts no older than `period`, add now, and allow
        at most `intensity` of them."""
        now = self.env.clock.monotonic()
        threshold = now - self.flags.period
        self._restarts = [now, *(r for r in self._restarts if r >= threshold)]
        return len(self._restarts) <= self.flags.intensity

    def _restart(self, failed: _Slot) -> None:
        if not self._add_restart():
            for s in self._slots:
                if s.ref is None:
                    self.env.registry.mark_down(s.name, "failed", "restart intensity reached")
            raise RestartIntensityExceeded(
                f"{self.link.id}: more than {self.flags.intensity} restarts "
                f"in {self.flags.period}s (last: {failed.name})"
            )
        group = self._group(failed)
        # Stop the rest of the group (reverse order); temporary ones are not restarted.
        self._stop_slots(reversed([s for s in group if s is not failed]))
        for s in [s for s in group if s is not failed and s.spec.restart is Restart.TEMPORARY]:
            self._slots.remove(s)
            group.remove(s)
        started: list[_Slot] = []
        for slot in group:
            try:
                self._start_slot(slot)
            except StartFailed as exc:
                logger.error("%s: restart of %s failed: %s", self.link.id, slot.name, exc)
                self._stop_slots(reversed(started))
                for s in group:
                    self.env.registry.mark_down(s.name, "restarting", str(exc))
                self.actor_ref.tell(_TryAgainRestart(failed.name))
                return
            started.append(slot)
            self.env.observer.child_restarted(slot.name)

    def _group(self, failed: _Slot) -> list[_Slot]:
        strategy = self.flags.strategy
        if strategy is Strategy.ONE_FOR_ALL:
            return list(self._slots)
        if strategy is Strategy.REST_FOR_ONE:
            return self._slots[self._slots.index(failed) :]
        return [failed]

    # -- start / stop one child -----------------------------------------------

    def _start_slot(self, slot: _Slot) -> None:
        link = Link(slot.name, on_exit=self._report_exit)
        try:
            ref = slot.spec.start(link, *slot.args)
        except Exception as exc:
            raise StartFailed(slot.name, exc) from exc
        try:
            link.started.result(timeout=slot.spec.start_timeout)
        except concurrent.futures.TimeoutError:
            ref.stop(block=False)
            raise StartFailed(slot.name, f"init() took over {slot.spec.start_timeout}s") from None
        except Exception as exc:
            raise StartFailed(slot.name, exc) from exc
        slot.ref = ref
        self.env.registry.register(slot.name, ref, supervisor=self.link.id)

    def _stop_slots(self, slots: Any) -> None:
        for slot in slots:
            ref, slot.ref = slot.ref, None  # forget it first: its exit report is stale
            self.env.registry.unregister(slot.name)
            if ref is None:
                continue
            try:
                ref.stop(block=True, timeout=slot.spec.shutdown)
            except pykka.Timeout:
                logger.error(
                    "%s/%s did not stop within %ss; abandoned",
                    self.link.id,
                    slot.name,
                    slot.spec.shutdown,
                )
            except pykka.ActorDeadError:
                pass

    def _report_exit(self, urn: str, reason: Exit) -> None:
        # Runs in the child's thread: only enqueue.
        try:
            self.actor_ref.tell(ChildExited(urn, reason))
        except pykka.ActorDeadError:
            pass

    def _find(self, name: str) -> _Slot:
        for s in self._slots:
            if s.name == name:
                return s
        raise NotFound(f"{self.link.id} has no child {name}")


def start_root(
    spec: ChildSpec,
    registry: Registry,
    on_exit: Callable[[Exit], None],
) -> pykka.ActorRef[Any]:
    """Start the root of a tree in the caller's thread and wait for it to be up.

    `on_exit` is called (from the root's thread) if the root ends: after an escalation
    it carries the crash, after an orderly stop it is a normal exit.
    """

    def exited(_urn: str, reason: Exit) -> None:
        if reason.abnormal:
            registry.mark_down(spec.id, "failed", str(reason))
        else:
            registry.unregister(spec.id)
        on_exit(reason)

    link = Link(spec.id, on_exit=exited)
    try:
        ref = spec.start(link)
    except Exception as exc:
        raise StartFailed(spec.id, exc) from exc
    try:
        link.started.result(timeout=spec.start_timeout)
    except concurrent.futures.TimeoutError:
        ref.stop(block=False)
        raise StartFailed(spec.id, f"init() took over {spec.start_timeout}s") from None
    except Exception as exc:
        raise StartFailed(spec.id, exc) from exc
    registry.register(spec.id, ref, supervisor="")
    return ref


def supervisor_spec(
    id: str,
    flags: SupFlags,
    children: Sequence[ChildSpec],
    env: SupervisorEnv,
    *,
    restart: Restart = Restart.PERMANENT,
    shutdown: float = 30.0,
    start_timeout: float = 30.0,
) -> ChildSpec:
    """The child spec of a nested supervisor."""

    def start(link: Link) -> pykka.ActorRef[Any]:
        return Supervisor.start(link, flags, children, env)

    return ChildSpec(
        id,
        start,
        restart=restart,
        shutdown=shutdown,
        type=ChildType.SUPERVISOR,
        start_timeout=start_timeout,
    )
