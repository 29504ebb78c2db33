"""The leases behind `Models.open`: admission, keep-alive and loading, from the event
loop, through the bridge. One `acquire` / `release` pair per request; HTTP never sees a
lease, only the `ModelSession` the facade makes of it.

Order matters: the request takes its place in the model's FIFO queue, then counts as
active for keep-alive (so no timer can unload the model under it), then waits for the
load. `release` undoes it in reverse; with keep_alive 0 it returns only once the model is
unloaded.

An unload asked for while the model is busy (`drain`) answers at once: the requests in
flight and in its queue finish, the last one's release unloads it, and a request that
comes meanwhile waits for that unload at the door (`_after_drain`) and loads the model
again: no request waits behind a stream of new ones, none sees more than one load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barrel.actors import bridge
from barrel.actors.admission import ModelQueues, QueueLimits
from barrel.actors.catalog import Catalog
from barrel.actors.keepalive import Keepalive
from barrel.actors.loader import Loader, ModelSpec, model_options_for
from barrel.actors.memory import estimate, planner
from barrel.actors.registry import Registry
from barrel.actors.store_actor import StoreActor
from barrel.config import Config
from barrel.engine.context import EngineOptions, KVType, LoraAdapter, runs_on_cpu
from barrel.engine.engine import Engine
from barrel.errors import BarrelError, CallTimeout, InvalidRequest, NotFound, Unavailable
from barrel.futures import Reply, ToLoop
from barrel.store.gguf_meta import plain_attention, read_gguf
from barrel.store.manifests import ADAPTER, PROJECTOR
from barrel.store.names import ModelName
from barrel.store.store import ModelStore, config_for, details_of
from barrel.values import LoadedModel

logger = logging.getLogger(__name__)

ADMISSION, KEEPALIVE, LOADER = "admission", "keepalive", "loader"
LOAD_ASK_TIMEOUT = 120.0
LOAD_PROGRESS_S = 2.0
LOCAL_SPEC_TTL_S = 2.0
NO_TICKET = 0  # a lease outside the queue (admission's tickets start at 1)


@dataclass
class Lease:
    model: str
    ticket: int
    engine: Engine
    spec: ModelSpec


class Lifecycle:
    def __init__(self, config: Config, registry: Registry, store: ModelStore) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.progress_every = LOAD_PROGRESS_S
        # GGUF metadata of local files, by (path, size, mtime): read once, not per request.
        self._local_meta: dict[tuple[str, int, int], dict[str, Any]] = {}
        # Specs of local files, each reused for LOCAL_SPEC_TTL_S: a request to a busy
        # model then makes no catalog call and no stat on its way to the engine.
        self._local_specs: dict[str, tuple[float, ModelSpec]] = {}
        # Specs of store models, by name: (checked at, manifest (size, mtime), spec). A
        # spec is reused while its manifest file is unchanged (checked with one stat,
        # at most every LOCAL_SPEC_TTL_S); a create, edit or pull rewrites the manifest.
        self._store_specs: dict[str, tuple[float, tuple[int, int], ModelSpec]] = {}
        # The engine each model's last request got (see `_engine`).
        self._engines: dict[str, Engine] = {}
        # Requests in each model's queue for a place; its engine hears (`Engine.set_queued`).
        self._queued: dict[str, int] = {}
        # Unloads asked for while the model served others, by model: they hear when its
        # last request ended and the model went (loop thread only).
        # models draining (loop thread): set once the model is unloaded
        self._draining: dict[str, asyncio.Event] = {}

    # -- resolution -------------------------------------------------------------------

    async def spec(self, model: str) -> ModelSpec:
        """What loading `model` means: file, context, sequences, its draft model (400/404
        before any slow work)."""
        spec = await self._spec_of(model)
        draft = spec.parameters.get("draft_model") or self.config.models.drafts.get(spec.name)
        if not draft or spec.engine.draft_model is not None:
            return spec
        if self.config.resolve_alias(str(draft)) == spec.name:
            raise InvalidRequest(f"model {spec.name!r} cannot be its own draft model")
        drafter = await self._spec_of(str(draft))
        return dataclasses.replace(
            spec,
            engine=dataclasses.replace(spec.engine, draft_model=drafter.path),
            estimate_bytes=spec.estimate_bytes + drafter.size_bytes,
        )

    async def _spec_of(self, model: str) -> ModelSpec:
        name = self.config.resolve_alias(model)
        now = time.monotonic()
        cached = self._local_specs.get(name)
        if cached is not None and now - cached[0] < LOCAL_SPEC_TTL_S:
            return cached[1]
        stored = self._store_specs.get(name)
        if stored is not None and now - stored[0] < LOCAL_SPEC_TTL_S:
            return stored[2]
        catalog = self.registry.get("catalog")
        try:
            local = await bridge.call(catalog, Catalog.lookup, name)
            meta = await self._meta_of(local.path)
            details = meta.pop("details", {})
            # NAME:latest is NAME: one engine, under the name it was registered with
            spec = self._spec(local.name, local.path, local.size, meta, {}, details, local.digest)
            if local.projector is not None:
                extra = (await asyncio.to_thread(local.projector.stat)).st_size
                spec = dataclasses.replace(
                    spec,
                    engine=dataclasses.replace(spec.engine, mmproj=local.projector),
                    estimate_bytes=spec.estimate_bytes + extra,
                )
            self._local_specs[name] = (now, spec)
            return spec
        except NotFound:
            pass
        return await self._store_spec(name, now)

    async def _store_spec(self, name: str, now: float) -> ModelSpec:
        stamp = await asyncio.to_thread(self._manifest_stamp, name)
        cached = self._store_specs.get(name)
        if cached is not None and stamp is not None and cached[1] == stamp:
            self._store_specs[name] = (now, stamp, cached[2])
            return cached[2]
        spec = await self._read_store_spec(name)
        if stamp is not None:
            self._store_specs[name] = (now, stamp, spec)
        return spec

    def _manifest_stamp(self, name: str) -> tuple[int, int] | None:
        """Worker thread: the manifest's (size, mtime), None if there is none to stat."""
        try:
            st = self.store.manifests.path(ModelName.parse(name)).stat()
        except (OSError, BarrelError):
            return None
        return st.st_size, st.st_mtime_ns

    async def _read_store_spec(self, name: str) -> ModelSpec:
        rec = await bridge.call(self.registry.get("store"), StoreActor.get, name)
        if rec.model_path is None:
            raise NotFound(f"model {name!r} has no weights")
        size = sum(la.size for la in rec.manifest.layers if la.mediaType.endswith(".model"))
        params = dict(rec.parameters)
        # weight_residency: the Modelfile's PARAMETER, else the manifest's field, else config
        manifest_residency = rec.config.get("weight_residency")
        if "weight_residency" not in params and manifest_residency:
            params["weight_residency"] = manifest_residency
        spec = self._spec(
            str(rec.name), rec.model_path, size, rec.meta, params, rec.details(), rec.digest
        )
        # the Modelfile's ADAPTERs, applied at load at scale 1 (a request's `lora` field
        # may change their scales: ids in this order)
        loras = tuple(LoraAdapter(path) for path in rec.adapter_paths)
        return dataclasses.replace(
            spec,
            engine=dataclasses.replace(spec.engine, loras=loras, mmproj=rec.projector_path),
            # the projector and the adapters are loaded beside the weights
            estimate_bytes=spec.estimate_bytes
            + sum(la.size for la in rec.manifest.layers if la.mediaType in (PROJECTOR, ADAPTER)),
            template=rec.template,
            system=rec.system,
            messages=tuple(rec.messages),
            parameters=dict(rec.parameters),
        )

    async def _meta_of(self, path: Path) -> dict[str, Any]:
        st = await asyncio.to_thread(path.stat)
        key = (str(path), st.st_size, st.st_mtime_ns)
        meta = self._local_meta.get(key)
        if meta is None:
            info = await asyncio.to_thread(read_gguf, path)
            meta = {
                "context_length": info.context_length,
                "block_count": info.block_count,
                "head_count": info.head_count,
                "head_count_kv": info.head_count_kv,
                "embedding_length": info.embedding_length,
                "plain_attention": info.plain_attention,
                "details": details_of(config_for(info)),
            }
            self._local_meta[key] = meta
        return dict(meta)

    def _spec(
        self,
        name: str,
        path: Any,
        size: int,
        meta: dict[str, Any],
        params: dict[str, Any],
        details: dict[str, Any],
        digest: str,
    ) -> ModelSpec:
        d = self.config.models.defaults
        trained = int(meta.get("context_length") or self.config.models.max_context_size)
        n_ctx = int(params.get("num_ctx") or trained)
        n_ctx = max(64, min(n_ctx, self.config.models.max_context_size))
        kv_type = str(params.get("kv_cache_type", d.kv_cache_type))
        flash = params.get("flash_attn")
        model = model_options_for(params, d.extra_buffers)
        auto = d.kv_per_sequence == "auto"
        per_sequence = (
            runs_on_cpu(model) and _plain_attention(meta) if auto else bool(d.kv_per_sequence)
        )
        options = EngineOptions(
            n_ctx=n_ctx,
            n_batch=int(params.get("num_batch", d.num_batch)),
            n_ubatch=int(params.get("num_batch", d.num_batch)),
            prefill_step_s=d.prefill_step_s,
            prefill_order=d.prefill_order,
            n_seq_max=int(params.get("num_seq_max", d.num_seq_max)),
            threads=int(params.get("num_thread", d.num_thread)),
            kv_type=KVType(kv_type),
            flash_attn=d.flash_attn if flash is None else ("on" if flash else "off"),
            grammar_sample_s=self.config.limits.grammar_sample_s,
            speculation=str(params.get("speculation", d.speculation)),
            draft_max=max(0, min(64, int(params.get("draft_max", d.draft_max)))),
            kv_per_sequence=per_sequence,
        )
        margin = self.config.models.model_load_memory_margin_b
        # the KV cache is allocated once a sequence (and pinned prefix) when each has its own
        streams = options.n_seq_max + options.max_pins if per_sequence else 1
        estimate_bytes = estimate(size, meta, n_ctx * streams, kv_type, margin)
        shared_bytes = estimate(size, meta, n_ctx, kv_type, margin)
        return ModelSpec(
            name=name,
            path=path,
            engine=options,
            model=model,
            size_bytes=size,
            estimate_bytes=estimate_bytes,
            per_sequence_extra=estimate_bytes - shared_bytes if auto else 0,
            details=details,
            digest=digest,
            residency=str(
                params.get("weight_residency", self.config.models.weight_residency_default)
            ),
            queue_depth=int(params.get("queue_depth", d.queue_depth)),
            queue_timeout=float(params.get("queue_timeout", d.queue_timeout_s)),
        )

    # -- a request's lease --------------------------------------------------------------

    async def acquire(
        self,
        model: str,
        keep_alive: float | None = None,
        on_queued: Callable[[int], None] | None = None,
        on_loading: Callable[[float], None] | None = None,
        weight: int = 1,
    ) -> Lease:
        """Queue for the model, count as active, wait for the load. `on_queued(position)`
        hears each new queue position; `on_loading(seconds)` every `LOAD_PROGRESS_S`
        while the model loads (for SSE comments and pings). `weight`: the engine
        sequences the request runs (a many-choice request takes that many places)."""
        spec = await self.spec(model)
        return await self._acquire_spec(spec, keep_alive, on_queued, on_loading, weight)

    async def _acquire_spec(
        self,
        spec: ModelSpec,
        keep_alive: float | None,
        on_queued: Callable[[int], None] | None,
        on_loading: Callable[[float], None] | None,
        weight: int = 1,
    ) -> Lease:
        name = spec.name
        await self._after_drain(name)
        admission = self.registry.get(ADMISSION)
        keepalive = self.registry.get(KEEPALIVE)
        limits = QueueLimits(spec.engine.n_seq_max, spec.queue_depth)
        admitted = asyncio.Event()

        def notify(position: int) -> None:
            if position == 0:
                admitted.set()
            elif on_queued is not None:
                on_queued(position)

        # The queue place and the activity, asked together: one round trip of latency.
        # Counting as active while queued keeps the model loaded for the queue too.
        enqueued, activated = await asyncio.gather(
            bridge.call(
                admission, ModelQueues.enqueue, name, ToLoop().wrap(notify), limits, weight
            ),
            bridge.call(keepalive, Keepalive.acquire, name),
            return_exceptions=True,
        )
        if isinstance(enqueued, BaseException) or isinstance(activated, BaseException):
            ticket = NO_TICKET if isinstance(enqueued, BaseException) else enqueued[0]
            if isinstance(activated, BaseException):
                await self._give_back(name, ticket)
            else:
                await self._release(name, ticket, None)
            raise enqueued if isinstance(enqueued, BaseException) else activated  # type: ignore[misc]
        ticket, position = enqueued
        try:
            if position > 0:
                if on_queued is not None:
                    on_queued(position)
                self._queue(name, 1)
                try:
                    await asyncio.wait_for(admitted.wait(), spec.queue_timeout)
                except TimeoutError:
                    raise Unavailable(
                        f"waited {spec.queue_timeout:.0f}s in the queue of {name}", retry_after=5.0
                    ) from None
                finally:
                    self._queue(name, -1)
            engine = await self._engine(spec, on_loading)
        except BaseException:
            await self._release(name, ticket, None)
            raise
        return Lease(name, ticket, engine, spec)

    async def unqueued(self, model: str) -> Lease:
        """A lease that takes no place in the model's queue: for work that does not
        generate (tokenizing, counting tokens), which must not wait behind requests that
        do. It still counts as active, so the model stays loaded under it."""
        spec = await self.spec(model)
        await self._after_drain(spec.name)
        return await self._activate(spec, NO_TICKET, None)

    async def _after_drain(self, name: str) -> None:
        """A model that drains takes no new request: it waits here until the model is
        unloaded (then loads it again), at most as long as a load may take."""
        drained = self._draining.get(name)
        if drained is None:
            return
        timeout = self.config.models.defaults.load_timeout_s
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except TimeoutError:
            raise Unavailable(
                f"model {name} is still unloading after {timeout:.0f}s", retry_after=5.0
            ) from None

    async def _activate(
        self, spec: ModelSpec, ticket: int, on_loading: Callable[[float], None] | None
    ) -> Lease:
        """Count as active (no keep-alive timer can unload the model now), then wait for
        the load; on failure, give back what was taken."""
        try:
            await bridge.call(self.registry.get(KEEPALIVE), Keepalive.acquire, spec.name)
        except BaseException:
            await self._give_back(spec.name, ticket)
            raise
        try:
            engine = await self._engine(spec, on_loading)
        except BaseException:
            await self._release(spec.name, ticket, None)
            raise
        return Lease(spec.name, ticket, engine, spec)

    async def _engine(self, spec: ModelSpec, on_loading: Callable[[float], None] | None) -> Engine:
        """The model's engine: the one a request had last, while it runs and its loader
        is not stopping it (no actor call: the caller already counts as active, so an
        idle unload sees it), else from the loader."""
        cached = self._engines.get(spec.name)
        if cached is not None and cached.alive and not cached.closing:
            return cached
        engine = await self._load(spec, on_loading)
        self._engines[spec.name] = engine
        engine.set_queued(self._queued.get(spec.name, 0))
        return engine

    def _queue(self, name: str, change: int) -> None:
        """One request more (or fewer) waits in `name`'s queue for a place."""
        n = self._queued[name] = max(0, self._queued.get(name, 0) + change)
        engine = self._engines.get(name)
        if engine is not None:
            engine.set_queued(n)

    async def release(self, lease: Lease, keep_alive: float | None = None) -> None:
        await self._release(lease.model, lease.ticket, keep_alive)

    async def _release(self, name: str, ticket: int, keep_alive: float | None) -> None:
        unload_now = False
        try:
            unload_now = await bridge.call(
                self.registry.get(KEEPALIVE), Keepalive.release, name, keep_alive
            )
        finally:
            await self._give_back(name, ticket)
        if unload_now:
            try:
                await self.unload(name)
            finally:
                drained = self._draining.pop(name, None)
                if drained is not None:
                    drained.set()

    async def _give_back(self, name: str, ticket: int) -> None:
        if ticket == NO_TICKET:
            return
        ref = self.registry.whereis(ADMISSION)
        if ref is not None:
            try:
                await bridge.call(ref, ModelQueues.release, name, ticket)
            except BarrelError:
                logger.warning("could not release %s's queue place %s", name, ticket)

    async def _load(
        self, spec: ModelSpec, on_loading: Callable[[float], None] | None = None
    ) -> Engine:
        plan = None
        models = self.config.models
        if models.memory_aware_loading:
            idle = await bridge.call(self.registry.get(KEEPALIVE), Keepalive.idle_lru)
            plan = planner(models.memory_budget_bytes, idle, models.memory_budget_bytes > 0)
        loader = self.registry.get(LOADER)
        reply: Reply[Engine] = Reply()
        await bridge.call(loader, Loader.ensure, spec, plan, reply, timeout=LOAD_ASK_TIMEOUT)
        timeout = models.defaults.load_timeout_s
        loading = reply.future
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            left = timeout - (loop.time() - start)
            if left <= 0:
                raise CallTimeout(f"model {spec.name} did not load within {timeout:.0f}s")
            done, _ = await asyncio.wait({loading}, timeout=min(self.progress_every, left))
            if done:
                return loading.result()
            if on_loading is not None:
                on_loading(loop.time() - start)

    # -- management ---------------------------------------------------------------------

    async def embedder(self, model: str, keep_alive: float | None = None) -> Lease:
        """A lease on the model opened for embeddings (a second context, `<name>#embed`)."""
        spec = await self.spec(model)
        embed_spec = dataclasses.replace(
            spec.shared(),
            name=f"{spec.name}#embed",
            engine=dataclasses.replace(
                spec.engine, embedding=True, max_pins=0, kv_per_sequence=False
            ),
        )
        return await self._acquire_spec(embed_spec, keep_alive, None, None)

    async def preload(self, model: str, keep_alive: float | None = None) -> ModelSpec:
        """Load without a request (Ollama's empty prompt); the keep-alive timer starts."""
        spec = await self.spec(model)
        await self._after_drain(spec.name)
        await self._load(spec)
        await bridge.call(self.registry.get(KEEPALIVE), Keepalive.loaded, spec.name, keep_alive)
        return spec

    async def unload(self, model: str) -> bool:
        """Unload `model` and wait (at most LOAD_ASK_TIMEOUT) until it is gone."""
        name = self.config.resolve_alias(model)
        loader = self.registry.get(LOADER)
        done: Reply[bool] = Reply()
        await bridge.call(loader, Loader.unload, name, done)
        try:
            return bool(await done.wait(LOAD_ASK_TIMEOUT))
        except TimeoutError:
            raise CallTimeout(f"model {name} did not unload within {LOAD_ASK_TIMEOUT}s") from None

    async def drain(self, model: str) -> bool:
        """Ollama's unload (keep_alive 0 without a prompt): an idle model is unloaded now
        (True once it is gone); a busy one drains (False at once): it unloads when the
        requests in flight and in its queue have ended, and none is cut off."""
        name = self.config.resolve_alias(model)
        idle = await bridge.call(self.registry.get(KEEPALIVE), Keepalive.drain, name)
        if idle:
            return await self.unload(name)
        self._draining.setdefault(name, asyncio.Event())
        return False

    async def ps(self) -> list[LoadedModel]:
        """Loaded models with size, context, expiry, active and queued requests."""
        loaded = await bridge.call(self.registry.get(LOADER), Loader.loaded)
        activity = await bridge.call(self.registry.get(KEEPALIVE), Keepalive.snapshot)
        admission = self.registry.get(ADMISSION)
        out = []
        for name, spec in loaded.items():
            running, waiting = await bridge.call(admission, ModelQueues.status, name)
            a = activity.get(name)
            out.append(
                LoadedModel(
                    name=name,
                    # what is allocated (weights and KV cache), not the load's estimate
                    # with its safety margin
                    size=spec.estimate_bytes - self.config.models.model_load_memory_margin_b,
                    digest=spec.digest.removeprefix("sha256:"),
                    details=spec.details,
                    expires_at=a.expires_at if a and a.expires_at else None,
                    context_length=spec.engine.n_ctx,
                    active=a.active if a else 0,
                    running=running,
                    queued=waiting,
                    draining=bool(a and a.draining),
                )
            )
        return out


def _plain_attention(meta: dict[str, Any]) -> bool:
    """Whether the model attends over every cell in every layer: from a local file's
    header, else from a stored model's `model_info` (its GGUF metadata)."""
    if "plain_attention" in meta:
        return bool(meta["plain_attention"])
    return plain_attention(meta.get("model_info") or {})
