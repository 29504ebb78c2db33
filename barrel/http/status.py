"""GET /api/status: one JSON snapshot of the daemon for `barrel top` and dashboards:
loaded models with their queue, speed, KV use and residency, recent requests, pulls in
progress and supervisor restarts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from barrel import __version__
from barrel.actors import bridge
from barrel.actors.pulls import PullCoordinator
from barrel.errors import BarrelError
from barrel.http.keys import LIFECYCLE, METRICS, RESIDENCY, RUNTIME

routes = web.RouteTableDef()

PULL_ASK_TIMEOUT = 2.0


async def _pulls(request: web.Request) -> list[dict[str, Any]]:
    registry = request.app[RUNTIME].registry
    out = []
    for entry in registry.entries():
        if not entry.name.startswith("pull:"):
            continue
        ref = registry.whereis(entry.name)
        if ref is None:
            continue
        try:
            event = await bridge.call(ref, PullCoordinator.progress, timeout=PULL_ASK_TIMEOUT)
        except BarrelError:
            continue  # it just finished
        out.append({"model": entry.name.removeprefix("pull:"), **event})
    return out


@routes.get("/api/status")
async def status(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    resident = await asyncio.to_thread(request.app[RESIDENCY].resident)
    models = []
    for m in await request.app[LIFECYCLE].ps():
        live = metrics.live.get(m["name"])
        models.append(
            {
                **m,
                "state": "busy" if m["running"] else "idle",
                "resident_bytes": resident.get(m["name"], 0),
                "tokens_per_s": round(live.tokens_per_s(), 2) if live else 0.0,
                "active_sequences": live.active if live else 0,
                "kv_cells_used": live.kv_cells if live else 0,
                "cache_hit_ratio": round(live.cache_hit_ratio(), 4) if live else 0.0,
                "generated_tokens": live.generated if live else 0,
                "requests_done": live.requests if live else 0,
            }
        )
    return web.json_response(
        {
            "version": __version__,
            "uptime_s": round(time.time() - metrics.started, 1),
            "models": models,
            "recent_requests": list(metrics.recent)[::-1],
            "pulls": await _pulls(request),
            "restarts": dict(metrics.restart_counts),
        }
    )
