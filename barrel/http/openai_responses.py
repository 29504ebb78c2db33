"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The responses codec (barrel.http.codecs.openai_responses) over the one generation
handler. Responses are kept in memory for `[responses] store_ttl_s` unless `store` is
false, so `previous_response_id` can continue one; an unknown or expired id is a 400
that says so.
"""

from __future__ import annotations

from aiohttp import web

from barrel.errors import NotFound
from barrel.http.codecs import openai_responses as codec
from barrel.http.generate import SseTransport, conversation_of, serve
from barrel.http.response_store import ResponseStore
from barrel.pipeline.request import Message

routes = web.RouteTableDef()

STORE = web.AppKey("response_store", ResponseStore)


def store_of(request: web.Request) -> ResponseStore:
    return request.app[STORE]


@routes.post("/v1/responses")
@routes.post("/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    store = store_of(request)

    def history(response_id: str) -> tuple[Message, ...] | None:
        stored = store.get(response_id)
        return None if stored is None else stored.messages

    conversation = conversation_of(request)
    req, body = codec.decode(await request.read(), history, conversation)
    encoder = codec.ResponsesEncoder(req, body)

    def keep() -> None:
        if body.store:
            store.put(encoder.response, (*req.messages, *encoder.as_messages()))

    transport = SseTransport(request) if req.stream else None
    return await serve(request, req, encoder, transport, finished=keep)


@routes.get("/v1/responses/{id}")
@routes.get("/responses/{id}")
async def retrieve_response(request: web.Request) -> web.Response:
    stored = store_of(request).get(request.match_info["id"])
    if stored is None:
        raise NotFound(f"no stored response with id {request.match_info['id']!r}")
    return web.json_response(stored.response)


@routes.delete("/v1/responses/{id}")
@routes.delete("/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    if not store_of(request).delete(response_id):
        raise NotFound(f"no stored response with id {response_id!r}")
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})
