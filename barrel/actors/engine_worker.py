"""The actor that owns one model's engine.

It loads the model in response to a message it sends itself at start (so the supervisor's
start phase stays short), and crashes when the engine thread dies, so its supervisor
restarts it and the restart loads a fresh engine. Requests do not go through the actor:
callers get the `Engine` (from `engine_future()`) and submit to it directly; the actor is
the engine's owner and supervisor link, not a per-token relay.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barrel.actors.child import Child, Exit, Link
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine, EngineObserver
from barrel.engine.model import LlamaModel, ModelOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Load:
    pass


@dataclass(frozen=True)
class _EngineDied:
    error: BaseException


class EngineThreadDied(Exception):
    """Raised in the actor to crash it (let it crash) when its engine thread died."""


class EngineWorker(Child):
    def __init__(
        self,
        link: Link,
        path: Path,
        options: EngineOptions,
        model_options: ModelOptions | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        super().__init__(link)
        self.path = path
        self.options = options
        self.model_options = model_options or ModelOptions()
        self.observer = observer
        self.model: LlamaModel | None = None
        self._engine: Engine | None = None
        self._ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()

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
            self._engine = Engine(
                self.model,
                self.options,
                name=self.link.id,
                observer=self.observer,
                on_crash=self._engine_crashed,
            ).start()
        except Exception as exc:
            logger.error("loading %s failed: %s", self.link.id, exc)
            self._ready.set_exception(exc)
            raise
        logger.info("model %s loaded from %s", self.link.id, self.path)
        self._ready.set_result(self._engine)

    def _engine_crashed(self, error: BaseException) -> None:
        # Engine thread: only enqueue.
        self.actor_ref.tell(_EngineDied(error))

    def terminate(self, reason: Exit) -> None:
        if not self._ready.done():
            self._ready.set_exception(EngineThreadDied(f"{self.link.id} stopped before loading"))
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
        if self.model is not None:
            self.model.free()
            self.model = None
