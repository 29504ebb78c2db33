"""The pull coordinator: one actor per model being pulled, under `pull_sup`.

It owns the download (a worker thread running `barrel.store.pull.run_pull`), not the
HTTP handler: a client that disconnects only unsubscribes, and a second pull of the same
model subscribes to the running one instead of downloading again. Subscribers get the
progress so far, then every event, through the thread-safe sink each brings (a
`ToLoop.wrap`). When the pull ends the actor
sends the final event and stops (a temporary child: never restarted).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

from barrel.actors.child import Child, Exit, Link
from barrel.background import lower_priority
from barrel.errors import BarrelError
from barrel.store.pull import run_pull
from barrel.store.sources import Registries
from barrel.store.store import ModelStore

logger = logging.getLogger(__name__)

Sink = Callable[[dict[str, Any]], None]  # safe to call from any thread


def pull_name(model: str) -> str:
    return f"pull:{model}"


@dataclass(frozen=True)
class _Event:
    event: dict[str, Any]


@dataclass(frozen=True)
class _Finished:
    error: BaseException | None


class PullCoordinator(Child):
    def __init__(
        self,
        link: Link,
        store: ModelStore,
        model: str,
        registries: Registries,
        first: Sink | None = None,
    ) -> None:
        super().__init__(link)
        self.store = store
        self.model = model
        self.registries = registries
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._history: list[dict[str, Any]] = []
        self._subscribers: dict[int, Sink] = {}
        self._tokens = itertools.count(1)
        self._final: dict[str, Any] | None = None
        if first is not None:
            # The starter subscribes before the work begins: nothing can finish unseen.
            self._subscribers[0] = first

    def init(self) -> None:
        self._thread = threading.Thread(target=self._work, name=f"pull-{self.model}", daemon=True)
        self._thread.start()

    # -- API (asked from the event loop through the bridge) ---------------------------

    def subscribe(self, sink: Sink) -> tuple[int, list[dict[str, Any]]]:
        """Returns (token, events so far). The final event, if already out, is among
        them; otherwise it will come through `sink`."""
        token = next(self._tokens)
        if self._final is None:
            self._subscribers[token] = sink
        return token, list(self._history) + ([self._final] if self._final else [])

    def unsubscribe(self, token: int) -> None:
        self._subscribers.pop(token, None)

    def progress(self) -> dict[str, Any]:
        """The latest event (a blob's completed/total while it downloads)."""
        return dict(self._history[-1]) if self._history else {"status": "starting"}

    # -- messages -----------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Event):
            self._record(message.event)
            self._fanout(message.event)
        elif isinstance(message, _Finished):
            if message.error is None:
                final: dict[str, Any] = {"status": "success"}
            else:
                final = {"error": _describe(message.error)}
                if isinstance(message.error, BarrelError):
                    final["status_code"] = message.error.status
            self._final = final
            self._fanout(final, last=True)
            self.stop()
        else:
            return super().on_receive(message)
        return None

    def _record(self, event: dict[str, Any]) -> None:
        # Keep the history short: a progress event replaces the previous one of its blob.
        if self._history and "completed" in event:
            prev = self._history[-1]
            if prev.get("digest") == event.get("digest") and "completed" in prev:
                self._history[-1] = event
                return
        self._history.append(event)

    def _fanout(self, event: dict[str, Any], last: bool = False) -> None:
        for sink in list(self._subscribers.values()):
            sink(event)
        if last:
            self._subscribers.clear()

    # -- the worker thread --------------------------------------------------------

    def _work(self) -> None:
        lower_priority()  # a download must not slow inference down
        error: BaseException | None = None

        def emit(event: dict[str, Any]) -> None:
            if event.get("status") == "success":
                return  # sent by the actor as the final event
            try:
                self.actor_ref.tell(_Event(event))
            except pykka.ActorDeadError:
                self._cancel.set()

        try:
            run_pull(self.store, self.model, self.registries, emit, self._cancel)
        except Exception as exc:  # noqa: BLE001 - every failure goes to the subscribers
            logger.warning("pull of %s failed: %s", self.model, exc)
            error = exc
        try:
            self.actor_ref.tell(_Finished(error))
        except pykka.ActorDeadError:
            pass

    def terminate(self, reason: Exit) -> None:
        # Stopped before the end (shutdown): stop downloading; the partial file stays
        # for the next pull to resume.
        self._cancel.set()


def _describe(error: BaseException) -> str:
    if isinstance(error, BarrelError):
        return error.message
    return f"{type(error).__name__}: {error}"
