"""Liveness, readiness, metrics and version."""

from __future__ import annotations

from aiohttp import web

from barrel import __version__
from barrel.errors import BarrelError
from barrel.http.keys import METRICS, MODELS
from barrel.metrics import CONTENT_TYPE

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
    state = await request.app[MODELS].readiness()
    if not state.booted:
        return web.json_response({"status": "starting", "down": []}, status=503)
    if state.down:
        return web.json_response({"status": "degraded", "down": state.down}, status=503)
    return web.json_response({"status": "ready", "actors": state.live})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    models = request.app[MODELS]
    try:
        loaded = await models.ps()
        servable = [entry.name for entry in await models.manage.all_models()]
    except BarrelError:  # the tree is (re)starting: no model-server series this time
        loaded, servable = [], []
    running = [(m.name, m.queued, m.context_length) for m in loaded]
    metrics.model_server.loaded(running, servable)
    body = metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@routes.get("/api/version")
async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


@routes.get("/version")
async def server_version(_request: web.Request) -> web.Response:
    """vLLM's version probe, which gateways (SMG) use to tell a server that speaks the
    model-server metrics protocol (the vllm:* families of /metrics)."""
    return web.json_response({"version": __version__, "server": "barrel"})
