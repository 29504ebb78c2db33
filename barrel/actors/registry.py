"""The name registry the supervisors keep current.

A restarted actor has a new `ActorRef`; callers never cache refs to restartable actors
but look them up here by name at each call. Supervisors register a child when it
starts and mark it down when it exits; readiness reads the same table.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pykka

from barrel.errors import Unavailable

State = Literal["running", "restarting", "failed"]


@dataclass(frozen=True)
class Registration:
    name: str
    ref: pykka.ActorRef[Any] | None
    state: State
    supervisor: str
    reason: str = ""


class Registry:
    """Thread-safe name -> actor table. Reads are lock-protected dict lookups, cheap
    enough for the event loop."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, Registration] = {}
        self._monitors: dict[str, list[Callable[[str], None]]] = {}

    def register(self, name: str, ref: pykka.ActorRef[Any], supervisor: str) -> None:
        with self._lock:
            old = self._entries.get(name)
            live = old is not None and old.ref is not None and old.ref.is_alive()
            if live and old is not None and old.ref is not ref:
                raise ValueError(f"name {name!r} is already registered")
            self._entries[name] = Registration(name, ref, "running", supervisor)
            self._changed.notify_all()

    def mark_down(self, name: str, state: State, reason: str = "") -> None:
        with self._lock:
            old = self._entries.get(name)
            supervisor = old.supervisor if old else ""
            self._entries[name] = Registration(name, None, state, supervisor, reason)
            self._changed.notify_all()
            ended = self._monitors.pop(name, []) if state == "failed" else []
        for on_down in ended:
            on_down(reason)

    def unregister(self, name: str, reason: str = "") -> None:
        with self._lock:
            self._entries.pop(name, None)
            self._changed.notify_all()
            ended = self._monitors.pop(name, [])
        for on_down in ended:
            on_down(reason)

    def monitor(self, name: str, on_down: Callable[[str], None]) -> None:
        """Call `on_down(reason)` once when `name` ends for good: unregistered, or marked
        failed (a restart is not an end); at once if it is not running now. From the
        thread that reports the end, outside the lock: it should only enqueue."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.state != "failed":
                self._monitors.setdefault(name, []).append(on_down)
                return
        on_down(entry.reason if entry is not None else "")

    def whereis(self, name: str) -> pykka.ActorRef[Any] | None:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None or entry.ref is None or not entry.ref.is_alive():
            return None
        return entry.ref

    def get(self, name: str) -> pykka.ActorRef[Any]:
        """The live ref of `name`, or `Unavailable` naming it."""
        ref = self.whereis(name)
        if ref is None:
            raise Unavailable(f"{name} is not running", retry_after=1.0)
        return ref

    def entries(self) -> list[Registration]:
        with self._lock:
            return list(self._entries.values())

    def wait_for(
        self,
        name: str,
        *,
        other_than: pykka.ActorRef[Any] | None = None,
        timeout: float,
    ) -> pykka.ActorRef[Any]:
        """Block until `name` has a live ref (other than `other_than`: wait out a
        restart). Not for the event loop. Raises `Unavailable` after `timeout`."""

        def found() -> pykka.ActorRef[Any] | None:
            ref = self.whereis(name)
            return ref if ref is not None and ref is not other_than else None

        with self._changed:
            ref = self._changed.wait_for(found, timeout=timeout)
        if ref is None:
            raise Unavailable(f"{name} did not come up within {timeout}s", retry_after=1.0)
        return ref
