"""Liveness, readiness, metrics and version."""

from __future__ import annotations

import asyncio

from aiohttp import web

from barrel import __version__
from barrel.actors import bridge
from barrel.actors.child import Child
from barrel.errors import BarrelError
from barrel.http.keys import METRICS, RUNTIME
from barrel.metrics import CONTENT_TYPE

# A readiness probe waits this long for each actor to answer a ping from its own thread.
READY_PING_TIMEOUT = 1.0

routes = web.RouteTableDef()


@routes.get("/")
async def root(_request: web.Request) -> web.Response:
    """What Ollama answers, for tools that probe for an Ollama server."""
    return web.Response(text="Ollama is running", headers={"Server": f"barrel/{__version__}"})


@routes.get("/health")
async def health(_request: web.Request) -> web.Response:
    """Liveness: the event loop answers. Touches no actor."""
    return web.json_response({"status": "ok"})


@routes.get("/health/ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness: the tree is booted and every registered actor answers a ping."""
    runtime = request.app[RUNTIME]
    if not runtime.booted.is_set():
        return web.json_response({"status": "starting", "down": []}, status=503)
    entries = runtime.registry.entries()
    down = [
        {"name": e.name, "state": e.state, "reason": e.reason}
        for e in entries
        if e.ref is None or not e.ref.is_alive()
    ]
    live = [e for e in entries if e.ref is not None and e.ref.is_alive()]

    async def probe(ref: object) -> str | None:
        try:
            await bridge.call(ref, Child.ping, timeout=READY_PING_TIMEOUT)  # type: ignore[arg-type]
        except BarrelError as exc:
            return exc.message
        return None

    answers = await asyncio.gather(*(probe(e.ref) for e in live))
    down += [
        {"name": e.name, "state": "unresponsive", "reason": why}
        for e, why in zip(live, answers, strict=True)
        if why is not None
    ]
    if down:
        return web.json_response(
            {"status": "degraded", "down": sorted(down, key=lambda d: d["name"])}, status=503
        )
    return web.json_response({"status": "ready", "actors": len(live)})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@routes.get("/api/version")
async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})
