"""The aiohttp application: state, routes, and the tree's start and stop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping

from aiohttp import web

from barrel.actors.child import Exit
from barrel.actors.lifecycle import Lifecycle
from barrel.actors.registry import Registry
from barrel.actors.runtime import Runtime
from barrel.actors.supervisor import ChildSpec, SupervisorEnv
from barrel.actors.timers import Timers
from barrel.actors.tree import daemon_tree
from barrel.config import Config
from barrel.engine.residency import ResidencyTracker
from barrel.http import (
    anthropic,
    health,
    leases,
    ollama_gen,
    ollama_models,
    openai_chat,
    openai_completions,
    openai_models,
    openai_responses,
    status,
)
from barrel.http.keys import (
    CONFIG,
    LIFECYCLE,
    METRICS,
    ON_FATAL,
    ON_READY,
    RESIDENCY,
    RUNTIME,
    STORE,
)
from barrel.http.middlewares import MIDDLEWARES, decorate_response
from barrel.http.response_store import ResponseStore
from barrel.metrics import Metrics
from barrel.store.store import ModelStore

logger = logging.getLogger(__name__)

TreeBuilder = Callable[[SupervisorEnv], ChildSpec]


def make_app(
    config: Config,
    *,
    local_models: Mapping[str, str] | None = None,
    tree: TreeBuilder | None = None,
    on_fatal: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> web.Application:
    """Build the app. The tree boots in a worker thread after the server starts
    listening, so /health answers (and /health/ready says 503) while it comes up."""
    app = web.Application(
        middlewares=MIDDLEWARES,
        client_max_size=config.limits.max_request_body_bytes,
    )
    metrics = Metrics()
    app[CONFIG] = config
    app[METRICS] = metrics
    app[ON_FATAL] = on_fatal or (lambda why: logger.critical("fatal: %s", why))
    app[ON_READY] = on_ready or (lambda: None)
    models = {**config.models.local, **(local_models or {})}
    store = ModelStore(config.cache_root, config.import_dir)
    app[STORE] = store
    timers = Timers()
    tracker = ResidencyTracker()
    app[RESIDENCY] = tracker
    metrics.watch_residency(tracker.resident)
    build = tree or (lambda env: daemon_tree(config, env, models, store, timers, tracker, metrics))
    env = SupervisorEnv(Registry(), timers.clock, metrics)
    app[RUNTIME] = Runtime(build, env, timers)
    app[LIFECYCLE] = Lifecycle(config, env.registry)
    app.on_response_prepare.append(decorate_response)
    app.cleanup_ctx.append(_tree_lifecycle)
    app.router.add_routes(health.routes)
    app.router.add_routes(ollama_models.routes)
    app.router.add_routes(ollama_gen.routes)
    app.router.add_routes(anthropic.routes)
    app.router.add_routes(openai_chat.routes)
    app.router.add_routes(openai_completions.routes)
    app.router.add_routes(openai_models.routes)
    app.router.add_routes(openai_responses.routes)
    app.router.add_routes(status.routes)
    app[openai_responses.STORE] = ResponseStore(
        config.responses.store_ttl_s, config.responses.max_stored
    )
    app[leases.TEMPLATES] = {}
    return app


async def _tree_lifecycle(app: web.Application) -> AsyncIterator[None]:
    runtime = app[RUNTIME]
    loop = asyncio.get_running_loop()

    def root_exited(reason: Exit) -> None:  # root supervisor's thread
        loop.call_soon_threadsafe(app[ON_FATAL], f"supervision tree failed: {reason}")

    runtime.on_root_exit = root_exited

    async def boot() -> None:
        try:
            await asyncio.to_thread(runtime.boot)
        except Exception as exc:  # noqa: BLE001 - any boot failure is fatal
            logger.critical("supervision tree failed to start: %s", exc)
            app[ON_FATAL](f"supervision tree failed to start: {exc}")
            return
        app[ON_READY]()

    boot_task = asyncio.create_task(boot(), name="barrel-boot")
    yield
    await boot_task
    await asyncio.to_thread(runtime.stop)
