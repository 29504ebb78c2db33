"""Ollama's generation endpoints: /api/chat, /api/generate, /api/embed, /api/embeddings.

Chat and generate are the Ollama codec (barrel.http.codecs.ollama) over the one
generation handler, answered in NDJSON (or one object when `stream` is false); without
messages or a prompt they load the model, or unload it with keep_alive 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgspec
from aiohttp import web

from barrel.errors import InvalidRequest
from barrel.http.codecs import ollama as codec
from barrel.http.generate import NdjsonTransport, conversation_of, serve
from barrel.http.keys import CONFIG, MODELS
from barrel.pipeline import generation
from barrel.pipeline.request import ApiRequest

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


class EmbedBody(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: int | float | str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class LegacyEmbedBody(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str = ""
    keep_alive: int | float | str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # not read: no sampling


def _keep_alive(request: web.Request, value: int | float | str | None) -> float:
    seconds = codec.parse_keep_alive(value)
    return request.app[MODELS].keep_alive(seconds)


async def _lifecycle_only(
    request: web.Request, model: str, keep_alive: float | None
) -> web.Response:
    """Ollama's preload (no prompt / no messages) and unload (keep_alive 0) answers."""
    models = request.app[MODELS]
    start = time.perf_counter()
    if keep_alive == 0:
        await models.unload(model)
        reason = "unload"
    else:
        await models.preload(model, models.keep_alive(keep_alive))
        reason = "load"
    return web.json_response(
        {
            "model": model,
            "created_at": codec.iso_ns(time.time()),
            "response": "",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": reason,
            "total_duration": codec.ns(time.perf_counter() - start),
            "load_duration": codec.ns(time.perf_counter() - start),
        }
    )


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    req, _ = codec.decode_chat(await request.read(), conversation_of(request))
    return await _generate(request, req, chat=True)


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    conversation = conversation_of(request)
    req, _ = codec.decode_generate(await request.read(), conversation)
    return await _generate(request, req, chat=False)


async def _generate(request: web.Request, req: ApiRequest, *, chat: bool) -> web.StreamResponse:
    if not req.messages and req.completion is None:
        generation.check(req, request.app[CONFIG].limits)  # its options too, though unused
        return await _lifecycle_only(request, req.model, req.keep_alive)
    transport = NdjsonTransport(request) if req.stream else None
    return await serve(request, req, codec.OllamaEncoder(req, chat=chat), transport)


# -- embeddings ---------------------------------------------------------------------


def shorten_embedding(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalised again (Matryoshka-style shortening)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    if dimensions < 1:
        raise InvalidRequest("dimensions must be positive")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    body: EmbedBody = codec.decode_body(await request.read(), EmbedBody)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    cap = request.app[CONFIG].limits.max_embedding_inputs
    if not inputs or len(inputs) > cap:
        raise InvalidRequest(f"input must hold 1 to {cap} items")
    keep_alive = _keep_alive(request, body.keep_alive)
    started = time.perf_counter()
    async with request.app[MODELS].open(body.model, keep_alive=keep_alive, embedding=True) as s:
        load_s = time.perf_counter() - started
        tokens = await asyncio.to_thread(lambda: [s.tokenize(t) for t in inputs])
        vectors = await s.embed(tokens, truncate=body.truncate)
    return web.json_response(
        {
            "model": body.model,
            "embeddings": [shorten_embedding(v, body.dimensions) for v in vectors],
            "total_duration": codec.ns(time.perf_counter() - started),
            "load_duration": codec.ns(load_s),
            "prompt_eval_count": sum(len(t) for t in tokens),
        }
    )


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body: LegacyEmbedBody = codec.decode_body(await request.read(), LegacyEmbedBody)
    keep_alive = _keep_alive(request, body.keep_alive)
    async with request.app[MODELS].open(body.model, keep_alive=keep_alive, embedding=True) as s:
        tokens = s.tokenize(body.prompt)
        (vector,) = await s.embed([tokens], truncate=True, normalize=False)
    return web.json_response({"embedding": vector})
