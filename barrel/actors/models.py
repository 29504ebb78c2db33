"""The facade HTTP talks to: models to open, manage and watch.

    async with models.open("qwen", on_queued=..., on_loading=...) as session:
        gen = await barrel.pipeline.generation.start(session, req)
        async for index, event in merged(gen.runs): ...

`open` takes a lease (a place in the model's FIFO queue, activity for keep-alive, the
loaded engine; see `barrel.actors.lifecycle`) and yields a `ModelSession` valid only
inside the block. Model management (`models.manage`), loaded models (`ps`), status and
readiness go through here too, so HTTP never holds an engine, a store or an actor ref.

Runs on the event loop; every actor is reached through `barrel.actors.bridge`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from barrel.actors import bridge
from barrel.actors.child import Child
from barrel.actors.lifecycle import Lease, Lifecycle
from barrel.actors.manage import ModelManager
from barrel.actors.mcp import ToolDirectory
from barrel.actors.model_session import ModelCaches, ModelSession
from barrel.actors.runtime import Runtime
from barrel.actors.tools import ToolServers
from barrel.config import Config, keep_alive_seconds
from barrel.engine.errors import EngineStopped
from barrel.engine.kvdisk import KVDisk
from barrel.engine.model import batch_invariant
from barrel.engine.residency import ResidencyTracker
from barrel.errors import BarrelError
from barrel.metrics import Metrics
from barrel.store.download import fetch_bounded
from barrel.store.netpolicy import NetPolicy
from barrel.store.store import ModelStore
from barrel.values import LoadedModel

logger = logging.getLogger(__name__)

# A readiness probe waits this long for each actor to answer a ping from its own thread.
READY_PING_TIMEOUT = 1.0


@dataclass(frozen=True)
class Readiness:
    booted: bool
    down: list[dict[str, Any]]
    live: int


class Models:
    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        store: ModelStore,
        metrics: Metrics,
        residency: ResidencyTracker,
        kv_disk: KVDisk | None = None,
        tools: ToolDirectory | None = None,
    ) -> None:
        self.config = config
        # tool servers: what a request may use, and the calls (barrel.actors.tools)
        self.tools = ToolServers(config, tools or ToolDirectory(), metrics)
        self.kv_disk = kv_disk
        self.runtime = runtime
        self.lifecycle = Lifecycle(config, runtime.registry, store)
        self.manage = ModelManager(config, runtime.registry, store, kv_disk)
        self.metrics = metrics
        self.residency = residency
        self._caches = ModelCaches(render_budget_s=config.limits.template_render_s)

    # -- sessions -----------------------------------------------------------------------

    @asynccontextmanager
    async def open(
        self,
        model: str,
        *,
        keep_alive: float | None = None,
        on_queued: Callable[[int], None] | None = None,
        on_loading: Callable[[float], None] | None = None,
        queued: bool = True,
        embedding: bool = False,
        sequences: int = 1,
    ) -> AsyncIterator[ModelSession]:
        """A session on `model` for the block's duration. `queued=False` takes no place in
        the queue (tokenizing, counting: they must not wait behind generation);
        `embedding` opens the model's embedding context; `sequences` is how many engine
        sequences the request will run (its weight in the queue). `on_queued(position)` and
        `on_loading(seconds)` hear the wait (for SSE comments and pings)."""
        lc = self.lifecycle
        if embedding:
            lease = await lc.embedder(model, keep_alive)
        elif queued:
            lease = await lc.acquire(
                model, keep_alive, on_queued=on_queued, on_loading=on_loading, weight=sequences
            )
        else:
            lease = await lc.unqueued(model)
        try:
            async with self._held(
                lease, runs=0 if embedding or not queued else sequences
            ) as session:
                yield session
        finally:
            await lc.release(lease, keep_alive)

    @asynccontextmanager
    async def _held(self, lease: Lease, *, runs: int) -> AsyncIterator[ModelSession]:
        llama = lease.engine.model
        if not llama.retain():
            raise EngineStopped(f"model {lease.model} was unloaded; try again", retry_after=1.0)
        session = ModelSession(
            lease.spec,
            lease.engine,
            self._caches,
            self.metrics.pipeline_timings,
            runs=runs,
        )
        try:
            yield session
        finally:
            session.close()
            llama.release()

    def keep_alive(self, value: Any) -> float:
        """Ollama's keep_alive: seconds, a duration string, 0 = now, negative = forever;
        None = the configured default. ValueError on anything else."""
        return keep_alive_seconds(value, self.config.models.default_keep_alive)

    async def fetch_image(self, url: str, max_bytes: int) -> bytes:
        """An image a request names by URL (at most `max_bytes`), under the network
        rules of pulls: public https, or an origin `registry.image_origins` trusts."""
        reg = self.config.registry
        policy = NetPolicy.trusting(reg.image_origins, private_networks=reg.private_networks)
        return await asyncio.to_thread(fetch_bounded, url, max_bytes, policy)

    async def crash_engine(self, model: str) -> None:
        """Kill the model's engine thread (fault injection for soak tests): its requests
        end with an error, its supervisor restarts it."""
        lease = await self.lifecycle.unqueued(model)
        try:
            lease.engine.inject_fault(RuntimeError("engine crash injected"))
        finally:
            await self.lifecycle.release(lease)

    async def preload(self, model: str, keep_alive: float | None = None) -> None:
        await self.lifecycle.preload(model, keep_alive)

    async def unload(self, model: str) -> bool:
        """Unload `model`: an idle one now (True once gone); a busy one once its requests
        have ended, answering at once (False: it drains)."""
        return await self.lifecycle.drain(model)

    async def ps(self) -> list[LoadedModel]:
        return await self.lifecycle.ps()

    # -- status -------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Loaded models with live engine figures, recent requests, pulls and restarts
        (for `barrel top`): each model as (what `ps` says, its live figures)."""
        metrics = self.metrics
        resident = await asyncio.to_thread(self.residency.resident)
        models = []
        for m in await self.ps():
            live = metrics.live.get(m.name)
            models.append(
                (
                    m,
                    {
                        "resident_bytes": resident.get(m.name, 0),
                        "tokens_per_s": round(live.tokens_per_s(), 2) if live else 0.0,
                        "active_sequences": live.active if live else 0,
                        "kv_cells_used": live.kv_cells if live else 0,
                        "cache_hit_ratio": round(live.cache_hit_ratio(), 4) if live else 0.0,
                        "generated_tokens": live.generated if live else 0,
                        "requests_done": live.requests if live else 0,
                    },
                )
            )
        return {
            "models": models,
            "batch_invariant": batch_invariant(),
            "recent_requests": list(metrics.recent)[::-1],
            "pulls": await self.manage.pulls(),
            "restarts": dict(metrics.restart_counts),
            "kv_states": await self._kv_states(),
            "tool_servers": [dataclasses.asdict(s) for s in self.tools.states()],
        }

    async def _kv_states(self) -> list[dict[str, Any]]:
        """Per model, the conversation states saved on disk (barrel.engine.kvdisk)."""
        if self.kv_disk is None:
            return []
        usage = await asyncio.to_thread(self.kv_disk.usage)
        return [
            {"model": model, "states": count, "bytes": size}
            for model, (count, size) in sorted(usage.items())
        ]

    async def readiness(self) -> Readiness:
        """Whether the tree is booted and which registered actors are down or do not
        answer a ping from their own thread."""
        runtime = self.runtime
        if not runtime.booted.is_set():
            return Readiness(False, [], 0)
        entries = runtime.registry.entries()
        down = [
            {"name": e.name, "state": e.state, "reason": e.reason}
            for e in entries
            if e.ref is None or not e.ref.is_alive()
        ]
        live = [e for e in entries if e.ref is not None and e.ref.is_alive()]

        async def probe(ref: Any) -> str | None:
            try:
                await bridge.call(ref, Child.ping, timeout=READY_PING_TIMEOUT)
            except BarrelError as exc:
                return exc.message
            return None

        answers = await asyncio.gather(*(probe(e.ref) for e in live))
        down += [
            {"name": e.name, "state": "unresponsive", "reason": why}
            for e, why in zip(live, answers, strict=True)
            if why is not None
        ]
        return Readiness(True, sorted(down, key=lambda d: d["name"]), len(live))

    @property
    def tree_alive(self) -> bool:
        return self.runtime.root_exit is None
