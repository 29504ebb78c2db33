"""GET /api/status: one JSON snapshot of the daemon for `barrel top` and dashboards:
loaded models with their queue, speed, KV use and residency, recent requests, pulls in
progress and supervisor restarts. Each model is its /api/ps entry with the live figures."""

from __future__ import annotations

import time

from aiohttp import web

from barrel import __version__
from barrel.http.codecs.ollama import ps_model
from barrel.http.keys import METRICS, MODELS

routes = web.RouteTableDef()


@routes.get("/api/status")
async def status(request: web.Request) -> web.Response:
    snapshot = await request.app[MODELS].status()
    snapshot["models"] = [{**ps_model(m), **live} for m, live in snapshot["models"]]
    started = request.app[METRICS].started
    return web.json_response(
        {"version": __version__, "uptime_s": round(time.time() - started, 1), **snapshot}
    )
