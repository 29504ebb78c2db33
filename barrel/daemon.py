"""`barrel serve`: run the HTTP server and the supervision tree until a signal.

SIGTERM / SIGINT: stop accepting, give in-flight requests `server.shutdown_grace_s` to
finish, stop the tree in reverse order, exit 0. A tree that cannot boot or whose root
crashes shuts the daemon down with exit 1 (so systemd restarts it). SIGUSR1 writes
every thread's stack to stderr (barrel.stacks, set up by the CLI before this module's
imports start threads).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping

from aiohttp import web

from barrel.config import Config
from barrel.http.app import make_app
from barrel.notify import notify, watchdog_interval
from barrel.services import Services, build_services, running

logger = logging.getLogger(__name__)


def serve(config: Config, local_models: Mapping[str, str]) -> int:
    return asyncio.run(_serve(config, local_models))


async def _serve(config: Config, local_models: Mapping[str, str]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def fatal(why: str) -> None:
        nonlocal exit_code
        logger.critical("shutting down: %s", why)
        exit_code = 1
        stop.set()

    def ready() -> None:
        where = f"{config.server.host}:{config.server.port}"
        notify("READY=1\nSTATUS=serving on " + where)

    def stopping() -> None:
        notify("STOPPING=1")
        stop.set()

    services = build_services(config, local_models)
    app = make_app(config, services)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping)
    watchdog = asyncio.create_task(_watchdog(services), name="barrel-watchdog")
    try:
        # The tree boots while the server starts listening, and stops after the server
        # has drained its requests.
        async with running(services, on_fatal=fatal, on_ready=ready):
            listened = await run_server(
                app, config.server.host, config.server.port, config.server.shutdown_grace_s, stop
            )
    finally:
        watchdog.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return exit_code if listened else 1


async def _watchdog(services: Services) -> None:
    """WATCHDOG=1 every half WatchdogSec while the loop runs and the tree's root lives:
    a stuck loop or a dead tree lets systemd restart the daemon."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        if services.runtime.root_exit is None:
            notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def run_server(
    app: web.Application, host: str, port: int, grace: float, stop: asyncio.Event
) -> bool:
    """Serve `app` until `stop` is set, then shut down gracefully: stop accepting, give
    requests in flight `grace` seconds to finish, cancel the rest, run the app's
    cleanup. Returns False if it could not listen."""
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,  # barrel.http.middlewares.access_log writes one line per request
        shutdown_timeout=grace,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        logger.critical("cannot listen on %s:%s: %s", host, port, exc)
        await runner.cleanup()
        return False
    for addr in runner.addresses:
        bound_host, bound_port = addr[0], addr[1]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        logger.info("listening on http://%s:%s", shown, bound_port)
    await stop.wait()
    logger.info("stopping: waiting up to %ss for requests in flight", grace)
    await runner.cleanup()
    logger.info("stopped")
    return True
