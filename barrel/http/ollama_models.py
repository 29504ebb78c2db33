"""Ollama's model-management endpoints: pull, create, copy, delete, show, tags, edit,
search, blobs, prune. Request bodies are checked with msgspec before any slow work; the
store is reached through its actor, pulls through their coordinators."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec
from aiohttp import web

from barrel.actors.manage import NewModel
from barrel.errors import BarrelError, CallTimeout, InvalidRequest
from barrel.http.codecs import ollama as codec
from barrel.http.codecs import read_body
from barrel.http.keys import CONFIG, MODELS

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


class _Named(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the older field name

    def target(self) -> str:
        value = self.model or self.name
        if not value:
            raise InvalidRequest("'model' is required")
        return value


class PullRequest(_Named, kw_only=True):
    insecure: bool = False
    stream: bool = True


class CopyRequest(msgspec.Struct):
    source: str
    destination: str


class ShowRequest(_Named, kw_only=True):
    verbose: bool = False


class EditRequest(_Named, kw_only=True):
    parameters: dict[str, Any]


class SearchRequest(msgspec.Struct):
    query: str = ""


async def _body(request: web.Request, kind: type[Any]) -> Any:
    raw = await request.read()
    try:
        return read_body(raw, kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from None


def _ndjson_line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _stream_ndjson(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    return resp


# -- pull -------------------------------------------------------------------------


@routes.post("/api/pull")
async def pull(request: web.Request) -> web.StreamResponse:
    body: PullRequest = await _body(request, PullRequest)
    manage = request.app[MODELS].manage
    model = manage.check_pull(body.target())
    async with manage.pull(model, body.insecure) as events:
        if body.stream:
            return await _stream_pull(request, events)
        return await _wait_pull(events, request.app[CONFIG].registry.pull_timeout_s)


async def _stream_pull(
    request: web.Request, events: asyncio.Queue[dict[str, Any]]
) -> web.StreamResponse:
    resp = await _stream_ndjson(request)
    while True:
        event = await events.get()
        final = "error" in event or event.get("status") == "success"
        event.pop("status_code", None)
        await resp.write(_ndjson_line(event))
        if final:
            break
    await resp.write_eof()
    return resp


async def _wait_pull(events: asyncio.Queue[dict[str, Any]], timeout: float) -> web.Response:
    async def final() -> dict[str, Any]:
        while True:
            event = await events.get()
            if "error" in event or event.get("status") == "success":
                return event

    try:
        event = await asyncio.wait_for(final(), timeout)
    except TimeoutError:
        raise CallTimeout(f"the pull is still running after {timeout:.0f}s; it goes on") from None
    if "error" in event:
        status = int(event.pop("status_code", 500))
        return web.json_response({"error": event["error"]}, status=status)
    return web.json_response({"status": "success"})


# -- create, copy, delete, edit ---------------------------------------------------------


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    body = codec.decode_create(await request.read())
    new = NewModel(
        name=body.model or body.name,
        modelfile=body.modelfile or "",
        from_=body.from_ or "",
        files=body.files or {},
        adapters=tuple((body.adapters or {}).values()),
        template=body.template,
        system=body.system,
        license=body.licenses,
        parameters=body.parameters or {},
        messages=body.roles_and_contents,
    )
    manage = request.app[MODELS].manage
    name, spec, files = manage.check_create(new)
    resp = await _stream_ndjson(request) if body.stream else None
    if resp is not None:
        await resp.write(_ndjson_line({"status": "reading model metadata"}))
    try:
        await manage.create(name, spec, files)
    except BarrelError as err:
        if resp is None:
            raise
        await resp.write(_ndjson_line({"error": err.message}))
        await resp.write_eof()
        return resp
    if resp is None:
        return web.json_response({"status": "success"})
    for status in ("writing manifest", "success"):
        await resp.write(_ndjson_line({"status": status}))
    await resp.write_eof()
    return resp


@routes.post("/api/copy")
async def copy(request: web.Request) -> web.Response:
    body: CopyRequest = await _body(request, CopyRequest)
    await request.app[MODELS].manage.copy(body.source, body.destination)
    return web.Response(status=200)


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    body: _Named = await _body(request, _Named)
    await request.app[MODELS].manage.delete(body.target())
    return web.Response(status=200)


@routes.post("/api/edit")
async def edit(request: web.Request) -> web.Response:
    body: EditRequest = await _body(request, EditRequest)
    digest = await request.app[MODELS].manage.edit(body.target(), body.parameters)
    return web.json_response({"status": "success", "digest": digest})


@routes.post("/api/prune")
async def prune(request: web.Request) -> web.Response:
    removed, partials = await request.app[MODELS].manage.prune()
    return web.json_response({"removed_blobs": removed, "removed_partials": partials})


# -- show, tags, search ---------------------------------------------------------------


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    models = await request.app[MODELS].manage.all_models()
    return web.json_response({"models": [m.summary() for m in models]})


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    body: ShowRequest = await _body(request, ShowRequest)
    return web.json_response(await request.app[MODELS].manage.show(body.target()))


@routes.post("/api/search")
async def search(request: web.Request) -> web.Response:
    body: SearchRequest = await _body(request, SearchRequest)
    return web.json_response({"models": await request.app[MODELS].manage.search(body.query)})


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    return web.json_response(
        {"models": [codec.ps_model(m) for m in await request.app[MODELS].ps()]}
    )


# -- blobs ----------------------------------------------------------------------------


@routes.route("HEAD", "/api/blobs/{digest}")
async def blob_exists(request: web.Request) -> web.Response:
    has = await request.app[MODELS].manage.has_blob(request.match_info["digest"])
    return web.Response(status=200 if has else 404)


@routes.post("/api/blobs/{digest}")
async def blob_upload(request: web.Request) -> web.Response:
    digest = request.match_info["digest"]
    await request.app[MODELS].manage.upload_blob(digest, request.content.iter_chunked(1 << 16))
    return web.Response(status=201)
