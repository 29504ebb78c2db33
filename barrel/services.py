"""Every service of one daemon, built in one place, and the tree's boot and stop.

`build_services` makes the config's store, timers, metrics, residency tracker, the
supervision runtime and the `Models` facade; nothing is started. `running(services, ...)`
boots the tree in a worker thread (so a server already listening answers /health, and
/health/ready says 503, while it comes up) and stops it when the block ends, whatever
ended it. `barrel serve` wraps its HTTP server in it; tests do the same around an app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from barrel.actors.child import Exit
from barrel.actors.mcp import ToolDirectory
from barrel.actors.models import Models
from barrel.actors.registry import Registry
from barrel.actors.runtime import Runtime
from barrel.actors.supervisor import ChildSpec, SupervisorEnv
from barrel.actors.timers import Clock, Timers
from barrel.actors.tree import daemon_tree
from barrel.config import Config
from barrel.engine.kvdisk import KVDisk
from barrel.engine.model import configure_kernels
from barrel.engine.residency import ResidencyTracker
from barrel.futures import ToLoop
from barrel.metrics import Metrics
from barrel.store.store import ModelStore

logger = logging.getLogger(__name__)

TreeBuilder = Callable[[SupervisorEnv], ChildSpec]


@dataclass(frozen=True)
class Services:
    config: Config
    store: ModelStore
    timers: Timers
    metrics: Metrics
    residency: ResidencyTracker
    runtime: Runtime
    models: Models
    kv_disk: KVDisk | None = None  # conversations kept across unloads (None: off)


def build_services(
    config: Config,
    local_models: Mapping[str, str] | None = None,
    tree: TreeBuilder | None = None,
    clock: Clock | None = None,
) -> Services:
    """`tree` replaces the daemon's tree and `clock` its timers' clock (tests: a
    `ManualClock`); `local_models` add to the config's."""
    configure_kernels(config.models.batch_invariant)  # before any model loads
    models = {**config.models.local, **(local_models or {})}
    store = ModelStore(config.cache_root, config.import_dir, trial_load=config.models.trial_load)
    timers = Timers(clock)
    tracker = ResidencyTracker()
    metrics = Metrics()
    metrics.watch_residency(tracker.resident)
    budget = config.models.kv_states_bytes
    disk = KVDisk(config.kv_states_dir, budget, metrics.kv_restored) if budget > 0 else None
    env = SupervisorEnv(Registry(), timers.clock, metrics)
    tools = ToolDirectory()
    build = tree or (
        lambda env: daemon_tree(config, env, models, store, timers, tracker, metrics, disk, tools)
    )
    runtime = Runtime(build, env, timers)
    facade = Models(config, runtime, store, metrics, tracker, disk, tools)
    return Services(config, store, timers, metrics, tracker, runtime, facade, disk)


@asynccontextmanager
async def running(
    services: Services,
    on_fatal: Callable[[str], None],
    on_ready: Callable[[], None] = lambda: None,
) -> AsyncIterator[Services]:
    """Boot the tree (in a worker thread, while the block runs) and stop it at the end.
    `on_fatal(why)` runs on the loop when the tree cannot boot or its root exits;
    `on_ready()` once it is up."""
    runtime = services.runtime
    fatal = ToLoop().wrap(on_fatal)

    def root_exited(reason: Exit) -> None:  # the root supervisor's thread
        fatal(f"supervision tree failed: {reason}")

    runtime.on_root_exit = root_exited

    async def boot() -> None:
        try:
            await asyncio.to_thread(runtime.boot)
        except Exception as exc:  # noqa: BLE001 - any boot failure is fatal
            logger.critical("supervision tree failed to start: %s", exc)
            on_fatal(f"supervision tree failed to start: {exc}")
            return
        on_ready()

    boot_task = asyncio.create_task(boot(), name="barrel-boot")
    try:
        yield services
    finally:
        await boot_task
        await asyncio.to_thread(runtime.stop)
