"""An in-process app over its own services, wired as `barrel serve` wires them: the
tree boots when the app starts and stops with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping

from aiohttp import web

from barrel.actors.timers import Clock
from barrel.config import Config
from barrel.http.app import make_app
from barrel.services import Services, TreeBuilder, build_services, running

SERVICES = web.AppKey("test_services", Services)


def app_for(
    config: Config,
    *,
    local_models: Mapping[str, str] | None = None,
    tree: TreeBuilder | None = None,
    on_fatal: Callable[[str], None] | None = None,
    clock: Clock | None = None,
) -> web.Application:
    services = build_services(config, local_models, tree, clock)
    app = make_app(config, services)
    app[SERVICES] = services
    fatal = on_fatal or (lambda why: logging.getLogger(__name__).critical("fatal: %s", why))

    async def tree_ctx(_app: web.Application) -> AsyncIterator[None]:
        async with running(services, fatal):
            yield

    app.cleanup_ctx.append(tree_ctx)
    return app


def services_of(app: web.Application) -> Services:
    return app[SERVICES]


async def booted(app: web.Application) -> Services:
    """The app's services once its tree is up."""
    services = app[SERVICES]
    assert await asyncio.to_thread(services.runtime.booted.wait, 30), "the tree did not boot"
    return services
