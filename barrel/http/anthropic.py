"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

The messages codec (barrel.http.codecs.anthropic) over the one generation handler; a
stream carries pings while the request waits in the queue or for the load, and an error
after that is an `event: error` (503 becomes Anthropic's 529 "overloaded").
"""

from __future__ import annotations

from aiohttp import web

from barrel.http.codecs import anthropic as codec
from barrel.http.generate import SseTransport, conversation_of, serve, with_media
from barrel.http.keys import CONFIG, MODELS
from barrel.pipeline import generation

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    conversation = conversation_of(request)
    req, _ = codec.decode(await request.read(), counting=False, conversation=conversation)
    transport = SseTransport(request) if req.stream else None
    return await serve(request, req, codec.MessagesEncoder(req), transport)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    conversation = conversation_of(request)
    req, _ = codec.decode(await request.read(), counting=True, conversation=conversation)
    limits = request.app[CONFIG].limits
    generation.check(req, limits)
    req = await with_media(request, req)
    # counting does not wait behind generation
    async with request.app[MODELS].open(req.model, queued=False) as session:
        prepared = await generation.prepare(session, req, limits)
    return web.json_response({"input_tokens": len(prepared.prompt)})
