"""OpenAI's POST /v1/chat/completions: the chat codec (barrel.http.codecs.openai_chat)
over the one generation handler. While the request waits in the queue or for a load, a
stream carries SSE comments."""

from __future__ import annotations

from aiohttp import web

from barrel.http.codecs import openai_chat as codec
from barrel.http.generate import SseTransport, conversation_of, serve

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
@routes.post("/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req, body = codec.decode(await request.read(), conversation_of(request))
    transport = SseTransport(request) if req.stream else None
    return await serve(request, req, codec.encoder(req, body), transport)
