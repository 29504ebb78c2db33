"""Thread probes for actor tests: record what happened, wait on conditions, never sleep."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pykka

from barrel.actors.child import Child, Exit, Link
from barrel.errors import NotFound


class Probe:
    """A thread-safe event log with waits on predicates."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[tuple[Any, ...]] = []
        # child id -> how many upcoming init() calls must fail
        self.fail_init: dict[str, int] = {}
        # child id -> Event init() blocks on
        self.block_init: dict[str, threading.Event] = {}
        self.block_terminate: dict[str, threading.Event] = {}

    def record(self, *event: Any) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[list[tuple[Any, ...]]], bool], timeout: float = 5.0
    ) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.events), timeout=timeout):
                raise AssertionError(f"timed out waiting; events: {self.events}")

    def wait_count(self, event: tuple[Any, ...], n: int, timeout: float = 5.0) -> None:
        self.wait_for(lambda evs: evs.count(event) >= n, timeout)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        with self._cond:
            return [e for e in self.events if e[0] == kind]

    def clear(self) -> None:
        with self._cond:
            self.events.clear()


class Worker(Child):
    """A child that reports its lifecycle to a probe and misbehaves on request."""

    def __init__(self, link: Link, probe: Probe, *args: Any) -> None:
        super().__init__(link)
        self.probe = probe
        self.args = args

    def init(self) -> None:
        name = self.link.id
        gate = self.probe.block_init.get(name)
        if gate is not None:
            gate.wait(30)
        if self.probe.fail_init.get(name, 0) > 0:
            self.probe.fail_init[name] -= 1
            self.probe.record("init_failed", name)
            raise RuntimeError(f"{name} refuses to start")
        self.probe.record("start", name)

    def terminate(self, reason: Exit) -> None:
        gate = self.probe.block_terminate.get(self.link.id)
        if gate is not None:
            gate.wait(30)
        self.probe.record("stop", self.link.id, reason.kind)

    def echo(self, value: Any) -> Any:
        return value

    def get_args(self) -> tuple[Any, ...]:
        return self.args

    def crash(self) -> None:
        raise RuntimeError("boom")

    def not_found(self) -> None:
        raise NotFound("no such thing")

    def quit(self) -> None:
        self.stop()

    def block(self, gate: threading.Event) -> str:
        gate.wait(30)
        return "unblocked"

    def on_receive(self, message: Any) -> Any:
        if message == "crash":
            raise RuntimeError("boom (tell)")
        return super().on_receive(message)


def worker(probe: Probe) -> Callable[..., pykka.ActorRef[Any]]:
    """The start function of a `Worker` reporting to `probe`: start(link, *args)."""

    def start(link: Link, *args: Any) -> pykka.ActorRef[Any]:
        return Worker.start(link, probe, *args)

    return start
