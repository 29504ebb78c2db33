"""POST /debug/crash: fault injection for soak tests, routed only with
`server.fault_injection` (bench/soak.py turns it on for its own daemon)."""

from __future__ import annotations

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
