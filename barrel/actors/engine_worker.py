"""The actor that owns one model's engine.

It loads the model in response to a message it sends itself at start (so the supervisor's
start phase stays short), and crashes when the engine thread dies, so its supervisor
restarts it and the restart loads a fresh engine. Each incarnation reports its load's
outcome through the `on_ready` callback it was started with (the loader's, which only
enqueues a message). Requests do not go through the actor: callers get the `Engine` and
submit to it directly; the actor is the engine's owner and supervisor link, not a
per-token relay.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barrel import heap
from barrel.actors.child import Child, Exit, Link
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine, EngineObserver
from barrel.engine.kvdisk import KVDisk, SaveTo
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.engine.residency import ResidencyTracker, advise, pin_resident
from barrel.engine.types import Done
from barrel.errors import BarrelError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Load:
    pass


@dataclass(frozen=True)
class _EngineDied:
    error: BaseException


class EngineThreadDied(Exception):
    """Raised in the actor to crash it (let it crash) when its engine thread died."""


OnReady = Callable[[Engine | None, BaseException | None], None]
"""Called once per incarnation from the worker's thread: (engine, None) when loaded,
(None, error) when the load failed."""


class EngineWorker(Child):
    def __init__(
        self,
        link: Link,
        path: Path,
        options: EngineOptions,
        model_options: ModelOptions | None = None,
        observer: EngineObserver | None = None,
        residency: str = "eager",
        tracker: ResidencyTracker | None = None,
        model: str = "",
        on_ready: OnReady | None = None,
        disk: KVDisk | None = None,
        blob: str = "",
    ) -> None:
        super().__init__(link)
        self.path = path
        self.options = options
        self.model_options = model_options or ModelOptions()
        self.observer = observer
        self.residency = residency
        self.tracker = tracker
        self.model_label = model or link.id
        self.model: LlamaModel | None = None
        self._engine: Engine | None = None
        self._ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._on_ready = on_ready
        self.disk, self.blob = disk, blob  # saved states (barrel.engine.kvdisk)

    def init(self) -> None:
        self.actor_ref.tell(_Load())

    def engine_future(self) -> concurrent.futures.Future[Engine]:
        """Resolves to the running engine once loaded, or to the load error."""
        return self._ready

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Load):
            self._load()
        elif isinstance(message, _EngineDied):
            raise EngineThreadDied(f"engine of {self.link.id} died: {message.error}")
        else:
            return super().on_receive(message)
        return None

    def _load(self) -> None:
        try:
            self.model = LlamaModel.load(self.path, self.model_options)
            advise(self.path, self.residency)
            observer = self.observer
            if self.residency == "lazy_then_pin_resident":
                observer = _PinAfterFirstRequest(self.path, observer)
            self._engine = Engine(
                self.model,
                self.options,
                name=self.link.id,
                observer=observer,
                on_crash=self._engine_crashed,
                save_to=None
                if self.disk is None
                else SaveTo(self.disk, self.model_label, self.blob),
            ).start()
        except BarrelError as exc:
            # A model that cannot load (bad file, no memory for the context) fails the
            # same way on every restart: report it and stay up, failed, for the loader
            # to unload. Anything else is a bug: crash.
            logger.error("loading %s from %s failed: %s", self.link.id, self.path, exc)
            self._loaded(None, exc)
            return
        except Exception as exc:
            self._loaded(None, exc)
            raise
        logger.info("model %s loaded from %s (%s)", self.link.id, self.path, self.residency)
        if self.tracker is not None:
            self.tracker.register(self.model_label, self.path)
        self._loaded(self._engine, None)

    def _loaded(self, engine: Engine | None, error: BaseException | None) -> None:
        if error is not None:
            self._ready.set_exception(error)
        else:
            assert engine is not None
            self._ready.set_result(engine)
        if self._on_ready is not None:
            self._on_ready(engine, error)

    def _engine_crashed(self, error: BaseException) -> None:
        # Engine thread: only enqueue.
        self.actor_ref.tell(_EngineDied(error))

    def terminate(self, reason: Exit) -> None:
        if self.tracker is not None:
            self.tracker.unregister(self.model_label)
        if not self._ready.done():
            self._ready.set_exception(EngineThreadDied(f"{self.link.id} stopped before loading"))
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        if self.model is not None:
            self.model.free()
            self.model = None
            took = heap.trim()  # what the model's buffers took goes back now (barrel.heap)
            logger.debug(
                "%s: garbage collected in %.1f ms after the unload", self.link.id, took * 1e3
            )


class _PinAfterFirstRequest:
    """lazy_then_pin_resident: after the first finished request, lock the pages it made
    resident (engine thread, once per load)."""

    def __init__(self, path: Path, inner: EngineObserver | None) -> None:
        self.path = path
        self.inner = inner
        self.done = False

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        if self.inner is not None:
            self.inner.step(tokens, active, kv_cells, seconds)

    def first_token(self, seconds: float) -> None:
        if self.inner is not None:
            self.inner.first_token(seconds)

    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        if self.inner is not None:
            self.inner.occupancy(active, kv_cells, busy_cells)

    def inter_token(self, seconds: float) -> None:
        if self.inner is not None:
            self.inner.inter_token(seconds)

    def drafted(self, drafted: int, accepted: int) -> None:
        if self.inner is not None:
            self.inner.drafted(drafted, accepted)

    def next_turn(self, tokens: int) -> None:
        if self.inner is not None:
            self.inner.next_turn(tokens)

    def forced(self, tokens: int) -> None:
        if self.inner is not None:
            self.inner.forced(tokens)

    def finished(self, done: Done) -> None:
        if self.inner is not None:
            self.inner.finished(done)
        if not self.done:
            self.done = True
            locked = pin_resident(self.path)
            logger.info(
                "%s: pinned %d resident bytes after the first request", self.path.name, locked
            )
