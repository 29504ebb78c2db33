"""The loader: which models are in memory, loading them on demand and unloading them.

Each loaded model is a small supervisor (`modelsup:<name>`, one_for_one) under
`models_sup` holding the model's `EngineWorker`. A crash restarts the worker with a
fresh engine; crashes beyond that supervisor's intensity end it (it is a temporary child
of `models_sup`), the model is marked failed with its reason and its requests get 503,
while other models keep serving.

Concurrent requests for one model share one load: each `ensure` brings an `Answer`
(a `Reply` on the caller's loop) that is settled with the engine, or the load's error,
when the worker reports (`_Ready`). The actor never waits: the worker loads in response
to its own message, and unloading sends the stop to the model's supervisor and hears back
(`_Unloaded`), so `ensure` calls for other models are answered meanwhile. An engine whose
thread died is never handed out: requests wait for the restarted worker's report.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pykka

from barrel.actors.bridge import Answer, Call, call_sync
from barrel.actors.child import Child, Exit, Link
from barrel.actors.engine_worker import EngineWorker
from barrel.actors.keepalive import Forget, Keepalive, UnloadIdle
from barrel.actors.memory import ModelWouldOOM, available_bytes
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
from barrel.engine.kvdisk import KVDisk
from barrel.engine.model import LoadMode, ModelOptions
from barrel.engine.residency import ResidencyTracker
from barrel.errors import BarrelError, NotFound, Unavailable

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
    # The memory a KV stream per sequence adds to `estimate_bytes` over one shared
    # stream, when that layout was chosen for speed (`kv_per_sequence = "auto"`), not
    # asked for: the load falls back to the shared stream rather than fail or unload
    # another model for it (`shared`).
    per_sequence_extra: int = 0

    def shared(self) -> ModelSpec:
        """This spec with one KV stream that every sequence shares, if the stream per
        sequence was only chosen for speed; else itself."""
        if not self.per_sequence_extra:
            return self
        return dataclasses.replace(
            self,
            engine=dataclasses.replace(self.engine, kv_per_sequence=False),
            estimate_bytes=self.estimate_bytes - self.per_sequence_extra,
            per_sequence_extra=0,
        )


@dataclass
class LoadRecord:
    spec: ModelSpec
    generation: int  # which start of the model the worker reports belong to
    engine: Engine | None = None  # the serving engine once reported
    waiting: list[Answer] = field(default_factory=list)  # ensure calls awaiting it
    started_at: float = field(default_factory=time.time)

    def ready(self) -> bool:
        return self.engine is not None


@dataclass
class _Deferred:
    """A load that waits for its victims (memory-aware loading) or for the model's own
    earlier unload to finish."""

    spec: ModelSpec
    answer: Answer
    blocked_by: set[str]


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
        kv_disk: KVDisk | None = None,
    ) -> None:
        super().__init__(link)
        self.kv_disk = kv_disk  # where engines save their states as they stop
        self.tracker = tracker
        self.metrics = metrics
        self.registry = registry
        self.env = env
        self.models_sup = models_sup
        self.keepalive = keepalive
        self.intensity = intensity
        self.period = period
        self._models: dict[str, LoadRecord] = {}
        self._failed: dict[str, tuple[str, float]] = {}
        self._unloading: dict[str, list[Answer]] = {}
        self._deferred: list[_Deferred] = []
        self._generations = itertools.count(1)

    # -- API ------------------------------------------------------------------------

    def ensure(self, spec: ModelSpec, plan: Planner | None, answer: Answer) -> None:
        """Settle `answer` with the engine of `spec.name`, loading it if needed. `plan`
        (memory-aware loading) names idle models to unload first, or raises to refuse the
        load."""
        name = spec.name
        failed = self._failed.get(name)
        if failed is not None:
            reason, at = failed
            if time.monotonic() - at < FAILED_COOLDOWN_S:
                raise ModelFailed(f"model {name} failed: {reason}", retry_after=FAILED_COOLDOWN_S)
            del self._failed[name]
        current = self._models.get(name)
        if current is not None:
            if self.registry.whereis(sup_name(name)) is None:
                self._drop(name, "its supervisor gave up")
                raise ModelFailed(f"model {name} failed: {self._failed[name][0]}")
            if current.engine is not None and current.engine.alive:
                answer.resolve(current.engine)
            else:
                current.engine = None  # its thread died: the restarted worker will report
                current.waiting.append(answer)
            return
        loaded = [(m, lo.spec.estimate_bytes) for m, lo in self._models.items()]
        spec, names = fit(spec, plan, loaded)
        victims = {v for v in names if self.unload(v)}
        blocked = victims | ({name} if name in self._unloading else set())
        if blocked:
            self._deferred.append(_Deferred(spec, answer, blocked))
            return
        self._start(spec).waiting.append(answer)

    def unload(self, name: str, done: Answer | None = None) -> bool:
        """Stop the model's engine and free it; True if it was loaded. Returns at once:
        `done` hears True once the model is gone (False if it was not loaded)."""
        self._closing(name, True)
        loaded = self._models.pop(name, None)
        self._forget(name)
        sup = self.registry.whereis(self.models_sup)
        if loaded is None or sup is None:
            if name in self._unloading and done is not None:
                self._unloading[name].append(done)  # already on its way out
                return True
            if done is not None:
                done.resolve(False)
            return False
        # Requests waiting for this load wait on for the next one, after the unload.
        self._deferred += [_Deferred(loaded.spec, w, {name}) for w in loaded.waiting]
        self._unloading.setdefault(name, []).extend([done] if done is not None else [])
        try:
            sup.tell(Call("terminate_child", (sup_name(name),), answer=_TellBack(self, name)))
        except pykka.ActorDeadError:
            self._unloaded(name)
        return True

    def loaded(self) -> dict[str, ModelSpec]:
        return {name: lo.spec for name, lo in self._models.items() if lo.ready()}

    def failed(self) -> dict[str, str]:
        return {name: reason for name, (reason, _) in self._failed.items()}

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Ready):
            self._ready(message)
            return None
        if isinstance(message, _Unloaded):
            self._unloaded(message.model)
            return None
        if isinstance(message, _Down):
            loaded = self._models.get(message.model)
            if loaded is not None and loaded.generation == message.generation:
                self._drop(message.model, message.reason or "its supervisor gave up")
            return None  # else unloaded, or loaded again, since
        if isinstance(message, UnloadIdle):
            # Closing first, then the activity check: a request that found the engine
            # open counted itself active before, so the check sees it (guides/lifecycle.md).
            engine = self._closing(message.model, True)
            ka = self.registry.whereis(self.keepalive)
            if ka is not None:
                activity = call_sync(ka, Keepalive.snapshot).get(message.model)
                if activity is not None and activity.active > 0:
                    self._closing(message.model, False, engine)
                    return None  # a request started after the timer fired
            self.unload(message.model)
            return None
        return super().on_receive(message)

    def terminate(self, reason: Exit) -> None:
        # Whoever waits for a load or an unload hears now, not at its timeout.
        gone = Unavailable(f"the loader stopped ({reason})", retry_after=1.0)
        for loaded in self._models.values():
            for waiter in loaded.waiting:
                waiter.reject(gone)
        for deferred in self._deferred:
            deferred.answer.reject(gone)
        for dones in self._unloading.values():
            for done in dones:
                done.reject(gone)

    # -- internals ------------------------------------------------------------------

    def _start(self, spec: ModelSpec) -> LoadRecord:
        name = spec.name
        loaded = LoadRecord(spec, next(self._generations))
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
                on_ready=partial(self._report, name, loaded.generation),
                disk=self.kv_disk,
                blob=spec.digest,
            ),
            restart=Restart.PERMANENT,
            shutdown=30.0,
        )
        flags = SupFlags(Strategy.ONE_FOR_ONE, self.intensity, self.period)
        tree = supervisor_spec(sup_name(name), flags, [worker], self.env, restart=Restart.TEMPORARY)
        self._models[name] = loaded
        sup = self.registry.get(self.models_sup)
        call_sync(sup, Supervisor.start_child, sup_name(name), tree, timeout=60)
        # A request that came while the engine was dead waits for the restarted worker's
        # report; if the model's supervisor gives up instead, it hears it from here.
        self.registry.monitor(sup_name(name), partial(self._down, name, loaded.generation))
        return loaded

    def _down(self, name: str, generation: int, reason: str) -> None:
        # The thread that ended the model's supervisor: only enqueue.
        try:
            self.actor_ref.tell(_Down(name, generation, reason))
        except pykka.ActorDeadError:
            pass

    def _report(
        self, name: str, generation: int, engine: Engine | None, error: BaseException | None
    ) -> None:
        # The worker's thread: only enqueue.
        try:
            self.actor_ref.tell(_Ready(name, generation, engine, error))
        except pykka.ActorDeadError:
            pass

    def _ready(self, msg: _Ready) -> None:
        loaded = self._models.get(msg.model)
        if loaded is None or loaded.generation != msg.generation:
            return  # a report from a start that was unloaded since
        waiting, loaded.waiting = loaded.waiting, []
        if msg.error is not None:
            # The worker cannot load the model: stop its restarts, remember why.
            for waiter in waiting:
                waiter.reject(msg.error)
            self.unload(msg.model)
            self._failed[msg.model] = (str(msg.error), time.monotonic())
            return
        loaded.engine = msg.engine
        if self.metrics is not None:
            self.metrics.loads.labels(model=msg.model).inc()
        for waiter in waiting:
            waiter.resolve(msg.engine)

    def _unloaded(self, name: str) -> None:
        logger.info("model %s unloaded", name)
        for done in self._unloading.pop(name, []):
            done.resolve(True)
        for deferred in list(self._deferred):
            deferred.blocked_by.discard(name)
            if not deferred.blocked_by:
                self._deferred.remove(deferred)
                try:
                    self.ensure(deferred.spec, None, deferred.answer)
                except BarrelError as exc:
                    deferred.answer.reject(exc)

    def _closing(self, name: str, closing: bool, engine: Engine | None = None) -> Engine | None:
        """Mark the model's engine as about to stop (or not any more)."""
        loaded = self._models.get(name)
        engine = engine or (loaded.engine if loaded is not None else None)
        if engine is not None:
            engine.closing = closing
        return engine

    def _drop(self, name: str, reason: str) -> None:
        loaded = self._models.pop(name, None)
        entry = next((e for e in self.registry.entries() if e.name == sup_name(name)), None)
        why = entry.reason if entry and entry.reason else reason
        self._failed[name] = (why, time.monotonic())
        if loaded is not None:
            for waiter in loaded.waiting:
                waiter.reject(ModelFailed(f"model {name} failed: {why}"))
        self._forget(name)

    def _forget(self, name: str) -> None:
        ka = self.registry.whereis(self.keepalive)
        if ka is not None:
            ka.tell(Forget(name))


class _TellBack:
    """The answer of the models supervisor's terminate_child: back to the loader as a
    message (whatever the outcome, the model's subtree is gone or was never there)."""

    def __init__(self, loader: Loader, model: str) -> None:
        self._ref = loader.actor_ref
        self._model = model

    def resolve(self, value: Any) -> None:
        self._tell()

    def reject(self, exc: BaseException) -> None:
        if not isinstance(exc, NotFound):
            logger.warning("stopping %s: %s", self._model, exc)
        self._tell()

    def _tell(self) -> None:
        try:
            self._ref.tell(_Unloaded(self._model))
        except pykka.ActorDeadError:
            pass


@dataclass(frozen=True)
class _Ready:
    model: str
    generation: int
    engine: Engine | None
    error: BaseException | None


@dataclass(frozen=True)
class _Unloaded:
    model: str


@dataclass(frozen=True)
class _Down:
    """The model's supervisor ended (gave up after its restarts, or was stopped)."""

    model: str
    generation: int
    reason: str


def fit(
    spec: ModelSpec, plan: Planner | None, loaded: list[tuple[str, int]]
) -> tuple[ModelSpec, list[str]]:
    """The spec to load and the idle models to unload for it: a KV stream per sequence
    chosen only for speed gives way to one shared stream when its memory would refuse
    the load (ModelWouldOOM) or unload more models. Without memory-aware loading
    (`plan` None) nothing is refused or unloaded, but the speed-chosen layout still
    gives way when it would not fit in the memory free now."""
    shared = spec.shared()
    if plan is None:
        if shared is not spec and spec.estimate_bytes > available_bytes():
            return shared, []
        return spec, []
    try:
        victims = plan(spec, loaded)
    except ModelWouldOOM:
        if shared is spec:
            raise
        return shared, plan(shared, loaded)
    if victims and shared is not spec:
        fewer = plan(shared, loaded)
        if len(fewer) < len(victims):
            return shared, fewer
    return spec, victims


def model_options_for(
    params: dict[str, Any], extra_buffers: bool | Literal["auto"] = False
) -> ModelOptions:
    mode = LoadMode.MMAP
    if params.get("use_mlock"):
        mode = LoadMode.MMAP_MLOCK
    if params.get("use_mmap") is False:
        mode = LoadMode.NONE
    if params.get("weight_residency") == "pinned":
        mode = LoadMode.MMAP_MLOCK
    return ModelOptions(
        n_gpu_layers=int(params.get("num_gpu", 0)),
        load_mode=mode,
        extra_buffers=None if extra_buffers == "auto" else extra_buffers,
    )


def start_model_subtree(link: Link, subtree: ChildSpec) -> pykka.ActorRef[Any]:
    """models_sup's template: start the per-model supervisor it is given."""
    return subtree.start(link)


__all__ = ["Loader", "ModelFailed", "ModelSpec", "Supervisor", "UnloadIdle", "start_model_subtree"]
