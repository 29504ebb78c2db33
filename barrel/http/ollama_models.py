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

from barrel.actors import bridge
from barrel.actors.catalog import Catalog
from barrel.actors.pulls import PullCoordinator, pull_name
from barrel.actors.store_actor import StoreActor
from barrel.actors.supervisor import Supervisor
from barrel.actors.tree import PULL_SUP
from barrel.actors.tree import STORE as STORE_ACTOR
from barrel.errors import BarrelError, CallTimeout, InvalidRequest, NotFound, Unavailable
from barrel.http.keys import CONFIG, LIFECYCLE, RUNTIME, STORE
from barrel.store import modelfile as mf
from barrel.store.download import open_url
from barrel.store.names import ModelName, parse_digest
from barrel.store.sources import check_source
from barrel.store.store import ModelRecord, modified_iso
from barrel.store.upload import BlobUpload

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()

STORE_TIMEOUT = 30.0
CREATE_TIMEOUT = 600.0  # importing and hashing a multi-GB file


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


class CreateRequest(_Named, kw_only=True):
    modelfile: str | None = None
    from_: str | None = msgspec.field(default=None, name="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    quantize: str | None = None
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
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from None


def _name(request: web.Request, text: str) -> str:
    """Resolve an alias, then check the name grammar (400 on a bad name)."""
    resolved = request.app[CONFIG].resolve_alias(text)
    if "://" in resolved or resolved.split("/", 1)[0].lower() in ("hf.co", "huggingface.co"):
        return resolved
    return str(ModelName.parse(resolved))


def _store(request: web.Request) -> Any:
    return request.app[RUNTIME].registry.get(STORE_ACTOR)


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
    model = _name(request, body.target())
    check_source(model, request.app[CONFIG].import_dir.resolve())
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    ref, token = await _join_or_start(request, model, loop, events.put_nowait)
    try:
        if body.stream:
            return await _stream_pull(request, events)
        timeout = request.app[CONFIG].registry.pull_timeout_s
        return await _wait_pull(events, timeout)
    finally:
        if ref.is_alive():
            try:
                await bridge.call(ref, PullCoordinator.unsubscribe, token)
            except BarrelError:
                pass


async def _join_or_start(
    request: web.Request, model: str, loop: asyncio.AbstractEventLoop, sink: Any
) -> tuple[Any, int]:
    """Subscribe to the running pull of `model`, or start one subscribed from birth."""
    registry = request.app[RUNTIME].registry
    for _ in range(3):
        ref = registry.whereis(pull_name(model))
        if ref is None:
            try:
                ref = await bridge.call(
                    registry.get(PULL_SUP),
                    Supervisor.start_child,
                    pull_name(model),
                    model,
                    (loop, sink),
                )
                return ref, 0
            except InvalidRequest:
                continue  # a concurrent request started it first: join that one
        try:
            token, history = await bridge.call(ref, PullCoordinator.subscribe, loop, sink)
        except Unavailable:
            continue  # it finished in between: start afresh
        for event in history:
            sink(event)
        return ref, token
    raise Unavailable(f"could not start or join the pull of {model}", retry_after=1.0)


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


def _spec(body: CreateRequest) -> tuple[mf.Modelfile, dict[str, str] | None]:
    if body.quantize:
        raise InvalidRequest("quantize is not supported: Barrel does not requantize models")
    spec = mf.parse(body.modelfile) if body.modelfile else mf.Modelfile(from_=body.from_ or "")
    if body.from_:
        spec.from_ = body.from_
    if body.template is not None:
        spec.template = body.template
    if body.system is not None:
        spec.system = body.system
    if body.license is not None:
        spec.license = [body.license] if isinstance(body.license, str) else list(body.license)
    if body.parameters:
        spec.parameters.update(mf.normalize_parameters(body.parameters))
    if body.messages:
        spec.messages = [
            {"role": str(m.get("role", "")), "content": str(m.get("content", ""))}
            for m in body.messages
        ]
    for digest in (body.adapters or {}).values():
        parse_digest(digest)
        spec.adapters.append(digest)
    files = body.files or None
    for digest in (files or {}).values():
        parse_digest(digest)
    if not spec.from_ and not files:
        raise InvalidRequest("one of 'from', 'files' or a Modelfile FROM line is required")
    return spec, files


@routes.post("/api/create")
async def create(request: web.Request) -> web.StreamResponse:
    body: CreateRequest = await _body(request, CreateRequest)
    name = _name(request, body.target())
    spec, files = _spec(body)
    if spec.from_ and not spec.from_.startswith("sha256"):
        spec.from_ = request.app[CONFIG].resolve_alias(spec.from_)
    resp = await _stream_ndjson(request) if body.stream else None
    if resp is not None:
        await resp.write(_ndjson_line({"status": "reading model metadata"}))
    try:
        await bridge.call(
            _store(request), StoreActor.create, name, spec, files, timeout=CREATE_TIMEOUT
        )
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
    src, dst = _name(request, body.source), _name(request, body.destination)
    await bridge.call(_store(request), StoreActor.copy, src, dst, timeout=STORE_TIMEOUT)
    return web.Response(status=200)


@routes.delete("/api/delete")
async def delete(request: web.Request) -> web.Response:
    body: _Named = await _body(request, _Named)
    await bridge.call(_store(request), StoreActor.delete, _name(request, body.target()))
    return web.Response(status=200)


@routes.post("/api/edit")
async def edit(request: web.Request) -> web.Response:
    body: EditRequest = await _body(request, EditRequest)
    name = _name(request, body.target())
    mf.normalize_parameters({k: v for k, v in body.parameters.items() if v is not None})
    digest = await bridge.call(_store(request), StoreActor.edit, name, body.parameters)
    return web.json_response({"status": "success", "digest": digest})


@routes.post("/api/prune")
async def prune(request: web.Request) -> web.Response:
    removed, partials = await bridge.call(_store(request), StoreActor.prune, timeout=STORE_TIMEOUT)
    return web.json_response({"removed_blobs": removed, "removed_partials": len(partials)})


# -- show, tags, search ---------------------------------------------------------------


def _summary(rec: ModelRecord) -> dict[str, Any]:
    return {
        "name": str(rec.name),
        "model": str(rec.name),
        "modified_at": modified_iso(rec.modified_at),
        "size": rec.size,
        "digest": rec.digest.removeprefix("sha256:"),
        "details": rec.details(),
    }


def _details(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "gguf",
        "family": config.get("model_family", ""),
        "families": config.get("model_families", []),
        "parameter_size": config.get("model_type", ""),
        "quantization_level": config.get("file_type", ""),
    }


async def _local_models(request: web.Request) -> list[dict[str, Any]]:
    """Files registered with --model NAME=PATH, in /api/tags' shape."""
    catalog = request.app[RUNTIME].registry.get("catalog")
    out = []
    for local in await bridge.call(catalog, Catalog.list_models):
        config = await bridge.call(catalog, Catalog.describe, local.name, timeout=STORE_TIMEOUT)
        mtime = (await asyncio.to_thread(local.path.stat)).st_mtime
        out.append(
            {
                "name": local.name,
                "model": local.name,
                "modified_at": modified_iso(mtime),
                "size": local.size,
                "digest": "",
                "details": _details(config),
            }
        )
    return out


@routes.get("/api/tags")
async def tags(request: web.Request) -> web.Response:
    records = await bridge.call(_store(request), StoreActor.list_models, timeout=STORE_TIMEOUT)
    local = await _local_models(request)
    return web.json_response({"models": local + [_summary(r) for r in records]})


async def _show_local(request: web.Request, name: str) -> web.Response | None:
    catalog = request.app[RUNTIME].registry.get("catalog")
    try:
        local = await bridge.call(catalog, Catalog.lookup, name)
    except NotFound:
        return None
    config = await bridge.call(catalog, Catalog.describe, name, timeout=STORE_TIMEOUT)
    meta = config["barrel"]
    return web.json_response(
        {
            "modelfile": f"# Modelfile generated by Barrel\nFROM {local.path}\n",
            "parameters": "",
            "template": meta.get("chat_templates", {}).get("", ""),
            "details": _details(config),
            "model_info": meta.get("model_info", {}),
            "capabilities": meta.get("capabilities", []),
        }
    )


@routes.post("/api/show")
async def show(request: web.Request) -> web.Response:
    body: ShowRequest = await _body(request, ShowRequest)
    local = await _show_local(request, request.app[CONFIG].resolve_alias(body.target()))
    if local is not None:
        return local
    rec: ModelRecord = await bridge.call(
        _store(request), StoreActor.get, _name(request, body.target())
    )
    meta = rec.meta
    templates: dict[str, str] = meta.get("chat_templates", {})
    out: dict[str, Any] = {
        "modelfile": "# Modelfile generated by Barrel\n" + rec.modelfile().render(),
        "parameters": mf.render_parameters(rec.parameters),
        "template": rec.template if rec.template is not None else templates.get("", ""),
        "details": rec.details(),
        "model_info": meta.get("model_info", {}),
        "capabilities": meta.get("capabilities", []),
        "modified_at": modified_iso(rec.modified_at),
    }
    if rec.system is not None:
        out["system"] = rec.system
    if rec.license:
        out["license"] = "\n".join(rec.license)
    if rec.messages:
        out["messages"] = rec.messages
    return web.json_response(out)


@routes.post("/api/search")
async def search(request: web.Request) -> web.Response:
    body: SearchRequest = await _body(request, SearchRequest)
    query = body.query.lower()
    records = await bridge.call(_store(request), StoreActor.list_models, timeout=STORE_TIMEOUT)
    local = [{**_summary(r), "source": "local"} for r in records if query in str(r.name).lower()]
    remote = await asyncio.to_thread(_search_registries, request.app[CONFIG].registry.hosts, query)
    return web.json_response({"models": local + remote})


def _search_registries(hosts: dict[str, str], query: str) -> list[dict[str, Any]]:
    """The registries' catalogues (`/v2/_catalog`), filtered by `query`; a registry that
    does not answer is skipped."""
    found: list[dict[str, Any]] = []
    for host, base in hosts.items():
        try:
            with open_url(f"{base.rstrip('/')}/v2/_catalog", timeout=5.0) as resp:  # type: ignore[attr-defined]
                repos = json.loads(resp.read(4 << 20)).get("repositories", [])
        except (BarrelError, ValueError, AttributeError) as exc:
            logger.info("search: registry %s did not answer: %s", host, exc)
            continue
        for repo in repos:
            if isinstance(repo, str) and query in repo.lower():
                found.append(
                    {"name": repo.removeprefix("library/"), "registry": host, "source": "registry"}
                )
    return found


@routes.get("/api/ps")
async def ps(request: web.Request) -> web.Response:
    return web.json_response({"models": await request.app[LIFECYCLE].ps()})


# -- blobs ----------------------------------------------------------------------------


@routes.route("HEAD", "/api/blobs/{digest}")
async def blob_exists(request: web.Request) -> web.Response:
    digest = request.match_info["digest"]
    parse_digest(digest)
    has = await bridge.call(_store(request), StoreActor.has_blob, digest)
    return web.Response(status=200 if has else 404)


@routes.post("/api/blobs/{digest}")
async def blob_upload(request: web.Request) -> web.Response:
    """Stream the body to a temp file while hashing it (off the loop), then move it into
    place if it matches the digest in the path. No size cap: models are large."""
    digest = request.match_info["digest"]
    parse_digest(digest)
    upload = await asyncio.to_thread(BlobUpload, request.app[STORE].blobs)
    try:
        buffer = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            buffer += chunk
            if len(buffer) >= 1 << 20:
                await asyncio.to_thread(upload.write, bytes(buffer))
                buffer.clear()
        if buffer:
            await asyncio.to_thread(upload.write, bytes(buffer))
        await asyncio.to_thread(upload.commit, digest)
    finally:
        await asyncio.to_thread(upload.discard)
    return web.Response(status=201)
