"""The loader: which models are in memory, loading them on demand and unloading them.

Each loaded model is a small supervisor (`modelsup:<name>`, one_for_one) under
`models_sup` holding the model's `EngineWorker`. A crash restarts the worker with a
fresh engine; crashes beyond that supervisor's intensity end it (it is a temporary child
of `models_sup`), the model is marked failed with its reason and its requests get 503,
while other models keep serving.

Concurrent requests for one model share one load: they all get the same future, which
resolves to the engine or to the load's error. The actor never waits for a load: the
worker loads in response to its own message, and the future completes from there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pykka

from barrel.actors.child import Child, Link
from barrel.actors.engine_worker import EngineBoard, EngineWorker
from barrel.actors.keepalive import Forget, UnloadIdle
from barrel.actors.registry import Registry
from barrel.actors.supervisor import (
    ChildSpec,
    Restart,
    Strategy,
    Supervisor,
    SupervisorEnv,
    SupFlags,
    supervisor_spec,
)
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LoadMode, ModelOptions
from barrel.engine.residency import ResidencyTracker
from barrel.errors import NotFound, Unavailable

logger = logging.getLogger(__name__)

FAILED_COOLDOWN_S = 30.0


class ModelFailed(Unavailable):
    code = "model_failed"


@dataclass(frozen=True)
class ModelSpec:
    """What to load and how (resolved by the caller from the store or the catalog)."""

    name: str
    path: Path
    engine: EngineOptions
    model: ModelOptions = field(default_factory=ModelOptions)
    size_bytes: int = 0
    estimate_bytes: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    residency: str = "eager"
    queue_depth: int = 16
    queue_timeout: float = 300.0
    # What the chat pipeline needs from the model's Modelfile: a TEMPLATE override, a
    # SYSTEM prompt, MESSAGEs to prepend, and stored PARAMETERs (request options win).
    template: str | None = None
    system: str | None = None
    messages: tuple[dict[str, Any], ...] = ()
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Loaded:
    spec: ModelSpec
    future: concurrent.futures.Future[Engine]
    started_at: float = field(default_factory=time.time)


SpecResolver = Callable[[str], ModelSpec]
Planner = Callable[[ModelSpec, list[tuple[str, int]]], list[str]]  # -> models to unload first


def sup_name(model: str) -> str:
    return f"modelsup:{model}"


def worker_name(model: str) -> str:
    return f"model:{model}"


class Loader(Child):
    def __init__(
        self,
        link: Link,
        registry: Registry,
        env: SupervisorEnv,
        models_sup: str,
        keepalive: str,
        intensity: int = 3,
        period: float = 60.0,
        tracker: ResidencyTracker | None = None,
        metrics: Any = None,
    ) -> None:
        super().__init__(link)
        self.tracker = tracker
        self.metrics = metrics
        self.board = EngineBoard()
        self.registry = registry
        self.env = env
        self.models_sup = models_sup
        self.keepalive = keepalive
        self.intensity = intensity
        self.period = period
        self._models: dict[str, Loaded] = {}
        self._failed: dict[str, tuple[str, float]] = {}

    # -- API ------------------------------------------------------------------------

    def ensure(
        self, spec: ModelSpec, plan: Planner | None = None
    ) -> concurrent.futures.Future[Engine]:
        """The engine of `spec.name`, loading it if needed. `plan` (memory-aware loading)
        names idle models to unload first, or raises to refuse the load."""
        name = spec.name
        failed = self._failed.get(name)
        if failed is not None:
            reason, at = failed
            if time.monotonic() - at < FAILED_COOLDOWN_S:
                raise ModelFailed(f"model {name} failed: {reason}", retry_after=FAILED_COOLDOWN_S)
            del self._failed[name]
        current = self._models.get(name)
        if current is not None:
            if current.future.done() and current.future.exception() is not None:
                return current.future  # the load failed: every waiter gets its cause
            if self._alive(name, current):
                return current.future
            self._drop(name, "its supervisor gave up")
            if name in self._failed:
                raise ModelFailed(f"model {name} failed: {self._failed[name][0]}")
        if plan is not None:
            loaded = [(m, lo.spec.estimate_bytes) for m, lo in self._models.items()]
            for victim in plan(spec, loaded):
                self.unload(victim)
        return self._start(spec)

    def unload(self, name: str) -> bool:
        """Stop the model's engine and free it; True if it was loaded."""
        loaded = self._models.pop(name, None)
        self.board.remove(worker_name(name))
        self._forget(name)
        sup = self.registry.whereis(self.models_sup)
        if loaded is None or sup is None:
            return False
        try:
            sup.proxy().terminate_child(sup_name(name)).get(timeout=60)
        except NotFound:
            pass
        logger.info("model %s unloaded", name)
        return True

    def loaded(self) -> dict[str, ModelSpec]:
        return {
            name: lo.spec
            for name, lo in self._models.items()
            if lo.future.done() and lo.future.exception() is None
        }

    def failed(self) -> dict[str, str]:
        return {name: reason for name, (reason, _) in self._failed.items()}

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _LoadFailed):
            # The worker keeps failing to load: stop its restarts, remember why.
            if message.model in self._models:
                self.unload(message.model)
                self._failed[message.model] = (message.reason, time.monotonic())
            return None
        if isinstance(message, UnloadIdle):
            ka = self.registry.whereis(self.keepalive)
            if ka is not None:
                activity = ka.proxy().snapshot().get(timeout=5).get(message.model)
                if activity is not None and activity.active > 0:
                    return None  # a request started after the timer fired
            self.unload(message.model)
            return None
        return super().on_receive(message)

    # -- internals ------------------------------------------------------------------

    def _start(self, spec: ModelSpec) -> concurrent.futures.Future[Engine]:
        name = spec.name
        future: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        worker = ChildSpec(
            worker_name(name),
            partial(
                EngineWorker.start,
                path=spec.path,
                options=spec.engine,
                model_options=spec.model,
                observer=self.metrics.engine_observer(name) if self.metrics else None,
                residency=spec.residency,
                tracker=self.tracker,
                model=name,
                board=self.board,
            ),
            restart=Restart.PERMANENT,
            shutdown=30.0,
        )
        flags = SupFlags(Strategy.ONE_FOR_ONE, self.intensity, self.period)
        tree = supervisor_spec(sup_name(name), flags, [worker], self.env, restart=Restart.TEMPORARY)
        sup = self.registry.get(self.models_sup)
        sup.proxy().start_child(sup_name(name), tree).get(timeout=60)
        self._models[name] = Loaded(spec, future)
        ready = self.board.get(worker_name(name))
        if ready is None:
            self.unload(name)
            future.set_exception(ModelFailed(f"model {name} failed to start"))
            return future
        ready.add_done_callback(partial(_chain, future))
        ready.add_done_callback(partial(self._load_done, name))
        return future

    def _load_done(self, name: str, ready: concurrent.futures.Future[Engine]) -> None:
        # Worker thread: only enqueue.
        if ready.exception() is not None:
            try:
                self.actor_ref.tell(_LoadFailed(name, str(ready.exception())))
            except pykka.ActorDeadError:
                pass

    def _alive(self, name: str, loaded: Loaded) -> bool:
        """Still serving: refresh the future if the worker was restarted meanwhile."""
        if self.registry.whereis(sup_name(name)) is None:
            return False
        if not loaded.future.done():
            return True
        if loaded.future.exception() is not None:
            return False
        engine = loaded.future.result()
        if engine.alive:
            return True
        fresh = self.board.get(worker_name(name))
        if fresh is None or (fresh.done() and not fresh.exception() and fresh.result() is engine):
            return True  # restarting: the next ensure will find the new engine
        loaded.future = fresh
        return True

    def _drop(self, name: str, reason: str) -> None:
        self.board.remove(worker_name(name))
        self._models.pop(name, None)
        entry = next((e for e in self.registry.entries() if e.name == sup_name(name)), None)
        why = entry.reason if entry and entry.reason else reason
        self._failed[name] = (why, time.monotonic())
        self._forget(name)

    def _forget(self, name: str) -> None:
        ka = self.registry.whereis(self.keepalive)
        if ka is not None:
            ka.tell(Forget(name))


@dataclass(frozen=True)
class _LoadFailed:
    model: str
    reason: str


def _chain(
    target: concurrent.futures.Future[Engine], source: concurrent.futures.Future[Engine]
) -> None:
    if target.done():
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def model_options_for(params: dict[str, Any]) -> ModelOptions:
    mode = LoadMode.MMAP
    if params.get("use_mlock"):
        mode = LoadMode.MMAP_MLOCK
    if params.get("use_mmap") is False:
        mode = LoadMode.NONE
    if params.get("weight_residency") == "pinned":
        mode = LoadMode.MMAP_MLOCK
    return ModelOptions(n_gpu_layers=int(params.get("num_gpu", 0)), load_mode=mode)


def start_model_subtree(link: Link, subtree: ChildSpec) -> pykka.ActorRef[Any]:
    """models_sup's template: start the per-model supervisor it is given."""
    return subtree.start(link)


__all__ = ["Loader", "ModelFailed", "ModelSpec", "Supervisor", "UnloadIdle", "start_model_subtree"]
