"""OpenAI's GET /v1/models, GET /v1/models/{id} and POST /v1/embeddings.

Models are the local files registered at boot and the store's models, plus each alias
whose target exists; retrieving an alias answers with the alias as `id` and its target
as `root`. Embeddings open the model's embedding context (as /api/embed does).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Any

import msgspec
from aiohttp import web

from barrel.errors import InvalidRequest, NotFound
from barrel.http.keys import CONFIG, MODELS
from barrel.http.ollama_gen import shorten_embedding
from barrel.http.plain_routes import decode

routes = web.RouteTableDef()


async def _models(request: web.Request) -> dict[str, int]:
    """Every servable model name with its creation time (Unix seconds)."""
    out: dict[str, int] = {}
    for entry in await request.app[MODELS].manage.all_models():
        out.setdefault(entry.name, int(entry.modified_at))
    return out


def _entry(name: str, created: int, root: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "barrel",
    }
    if root is not None and root != name:
        entry["root"] = root
    return entry


def _anthropic(request: web.Request) -> bool:
    """Anthropic's SDKs send `anthropic-version` on every request: they get the shape of
    Anthropic's Models API."""
    return "anthropic-version" in request.headers


def _anthropic_entry(name: str, created: int) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp}


def _page(request: web.Request, names: list[str]) -> tuple[list[str], bool]:
    """Anthropic's paging: limit (1-1000, default 20), after_id or before_id."""
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise InvalidRequest("limit must be an integer") from None
    if not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be between 1 and 1000")
    after, before = request.query.get("after_id"), request.query.get("before_id")
    if after is not None:
        names = names[names.index(after) + 1 :] if after in names else []
    elif before is not None:
        names = names[: names.index(before)] if before in names else []
        return names[-limit:], len(names) > limit
    return names[:limit], len(names) > limit


@routes.get("/v1/models")
@routes.get("/models")
async def list_models(request: web.Request) -> web.Response:
    models = await _models(request)
    listed = dict(models)
    for alias, target in request.app[CONFIG].models.aliases.items():
        if target in models and alias not in models:
            listed[alias] = models[target]
    if _anthropic(request):
        page, more = _page(request, list(listed))
        return web.json_response(
            {
                "data": [_anthropic_entry(n, listed[n]) for n in page],
                "has_more": more,
                "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None,
            }
        )
    data = [_entry(name, created) for name, created in models.items()]
    for alias, target in request.app[CONFIG].models.aliases.items():
        if target in models and alias not in models:
            data.append(_entry(alias, models[target], target))
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{id:.+}")
@routes.get("/models/{id:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    asked = request.match_info["id"]
    name = request.app[CONFIG].resolve_alias(asked)
    models = await _models(request)
    if name not in models:
        try:  # a name the store resolves (a default tag, a full registry path)
            found = await request.app[MODELS].manage.find(name)
        except NotFound:
            raise NotFound(f"the model {asked!r} does not exist", param="model") from None
        created, root = int(found.modified_at), found.name
    else:
        created, root = models[name], name
    if _anthropic(request):
        return web.json_response(_anthropic_entry(asked, created))
    return web.json_response(_entry(asked, created, root))


# -- embeddings ---------------------------------------------------------------------------


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    model: str = ""
    input: Any = None  # a string, strings, token ids or lists of token ids
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _is_id(t: Any) -> bool:
    return type(t) is int  # not a bool: `false` is no token id


def _inputs(raw: Any, cap: int) -> list[str | list[int]]:
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(_is_id(t) for t in raw):
        items = [raw]  # one input given as token ids
    elif isinstance(raw, list):
        items = raw
    else:
        raise InvalidRequest("input must be a string, strings or token ids", param="input")
    if not 1 <= len(items) <= cap:
        raise InvalidRequest(f"input must hold 1 to {cap} items", param="input")
    for i, item in enumerate(items):
        ok_text = isinstance(item, str) and item != ""
        ok_ids = isinstance(item, list) and item and all(_is_id(t) and t >= 0 for t in item)
        if not (ok_text or ok_ids):
            raise InvalidRequest(
                "each input must be a non-empty string or a non-empty list of token ids",
                param=f"input[{i}]",
            )
    return items


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


@routes.post("/v1/embeddings")
@routes.post("/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body = await decode(request, EmbeddingsBody)
    items = _inputs(body.input, request.app[CONFIG].limits.max_embedding_inputs)
    if body.encoding_format not in ("float", "base64"):
        raise InvalidRequest("encoding_format must be float or base64", param="encoding_format")
    if body.dimensions is not None and body.dimensions < 1:
        raise InvalidRequest("dimensions must be at least 1", param="dimensions")
    async with request.app[MODELS].open(body.model, embedding=True) as session:
        for item in items:
            if isinstance(item, list):
                session.check_tokens(item, "input")
        tokens = await asyncio.to_thread(
            lambda: [session.tokenize(t) if isinstance(t, str) else list(t) for t in items]
        )
        vectors = await session.embed(tokens)
    if body.dimensions is not None and vectors and body.dimensions > len(vectors[0]):
        raise InvalidRequest(
            f"dimensions must be at most {len(vectors[0])} for this model", param="dimensions"
        )
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encode(shorten_embedding(v, body.dimensions), body.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    n = sum(len(t) for t in tokens)
    return web.json_response(
        {
            "object": "list",
            "data": data,
            "model": body.model,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
    )
