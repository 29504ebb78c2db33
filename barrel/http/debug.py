"""Routes for soak and leak tests, served only with `server.fault_injection` (bench/soak.py
and the tests turn it on for their own daemon):

- POST /debug/crash {"model": NAME}: kills that model's engine thread.
- GET /debug/memory: the Python heap as tracemalloc sees it (the daemon started with
  PYTHONTRACEMALLOC=1), after a full collection: `traced` bytes, and with `?top=N` the N
  places that grew most since the previous call (`top` empty on the first).
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import msgspec
from aiohttp import web

from barrel.errors import InvalidRequest
from barrel.http.keys import MODELS

routes = web.RouteTableDef()


class _Crash(msgspec.Struct):
    model: str


@routes.post("/debug/crash")
async def crash(request: web.Request) -> web.Response:
    try:
        body = msgspec.json.decode(await request.read(), type=_Crash)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    await request.app[MODELS].crash_engine(body.model)
    return web.json_response({"crashed": body.model})


_last: list[tracemalloc.Snapshot] = []


@routes.get("/debug/memory")
async def memory(request: web.Request) -> web.Response:
    top = request.query.get("top", "0")
    if not top.isdigit() or len(top) > 4:
        raise InvalidRequest("top must be a whole number of at most four digits")
    n = int(top)
    return web.json_response(await asyncio.to_thread(_memory, n))


def _memory(n: int) -> dict[str, object]:
    gc.collect()
    if not tracemalloc.is_tracing():
        return {"tracing": False, "garbage": len(gc.garbage)}
    traced, peak = tracemalloc.get_traced_memory()
    top: list[str] = []
    if n > 0:
        snap = tracemalloc.take_snapshot()
        if _last:
            top = [str(s) for s in snap.compare_to(_last[0], "lineno")[:n]]
        _last[:] = [snap]
    return {"tracing": True, "traced": traced, "peak": peak, "garbage": len(gc.garbage), "top": top}
