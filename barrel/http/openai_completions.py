"""OpenAI's legacy POST /v1/completions, and llama-server's POST /tokenize and /detokenize.

Completions are the completions codec (barrel.http.codecs.openai_completions) over the
one generation handler; while a stream waits in the queue or for a load, it carries SSE
comments.
"""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from barrel.http.codecs import openai_completions as codec
from barrel.http.generate import SseTransport, serve
from barrel.http.plain_routes import decode, unqueued

routes = web.RouteTableDef()


@routes.post("/v1/completions")
@routes.post("/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    req, body = codec.decode(await request.read())
    transport = SseTransport(request) if req.stream else None
    return await serve(request, req, codec.encoder(req, body), transport)


# -- tokenizer ----------------------------------------------------------------------------


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str = ""
    content: str = ""
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str = ""
    tokens: list[int] = msgspec.field(default_factory=list)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body = await decode(request, TokenizeBody)
    async with unqueued(request, body.model) as session:
        ids = await asyncio.to_thread(session.tokenize, body.content, add_special=body.add_special)
        if not body.with_pieces:
            return web.json_response({"tokens": ids})
        pieces = [{"id": t, "piece": session.piece(t, special=True)} for t in ids]
    return web.json_response({"tokens": pieces})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body = await decode(request, DetokenizeBody)
    async with unqueued(request, body.model) as session:
        session.check_tokens(body.tokens, "tokens")
        text = await asyncio.to_thread(session.detokenize, body.tokens)
    return web.json_response({"content": text})
