"""Reranking: POST /v1/rerank (and llama-server's /rerank, /reranking, /v1/reranking)
in the shape llama-server, Jina and Cohere clients use.

{model, query, documents: [string | {text}], top_n?, return_documents?} ->
{id, object: "list", model, results: [{index, relevance_score, document?: {text}}]
sorted by score, best first, at most top_n; usage: {prompt_tokens, total_tokens}}.
Hugging Face TEI's shape, as llama-server reads it: {query, texts: [string],
return_text?} -> [{index, score, text?}], best first.
Only for models whose GGUF declares rank pooling (capability "rerank"): checked before
the model is loaded. Errors in OpenAI's envelope.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from aiohttp import web

from barrel.errors import InvalidRequest
from barrel.http.keys import CONFIG, MODELS
from barrel.http.plain_routes import decode

routes = web.RouteTableDef()


class RerankBody(msgspec.Struct, kw_only=True):
    model: str = ""
    query: Any = None
    documents: Any = None
    top_n: int | None = None
    return_documents: bool = False
    texts: Any = None  # TEI's name for the documents: answered in TEI's shape
    return_text: bool = False  # TEI


def _texts(raw: Any, cap: int, name: str) -> list[str]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(f"{name} must be a non-empty array", param=name)
    if len(raw) > cap:
        raise InvalidRequest(f"{name}: at most {cap} per request", param=name)
    texts = []
    for item in raw:
        if isinstance(item, dict):
            item = item.get("text")
        if not isinstance(item, str):
            raise InvalidRequest(f"each of {name} must be a string or {{text: string}}", param=name)
        texts.append(item)
    return texts


async def rerank(request: web.Request) -> web.Response:
    body = await decode(request, RerankBody)
    if not isinstance(body.query, str) or not body.query:
        raise InvalidRequest("query must be a non-empty string", param="query")
    tei = body.texts is not None and body.documents is None
    cap = request.app[CONFIG].limits.max_embedding_inputs
    if body.texts is not None:
        texts = _texts(body.texts, cap, "texts")
    documents = texts if tei else _texts(body.documents, cap, "documents")
    if body.top_n is not None and body.top_n < 1:
        raise InvalidRequest("top_n must be at least 1", param="top_n")
    models = request.app[MODELS]
    shown = await models.manage.show(body.model)
    if "rerank" not in shown.get("capabilities", []):
        raise InvalidRequest(
            f"model {body.model!r} is not a reranker (its GGUF declares no rank pooling)",
            param="model",
        )
    async with models.open(body.model, embedding=True) as session:
        scores, tokens = await session.rerank(body.query, documents)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if tei:
        return web.json_response(
            [
                {
                    "index": i,
                    "score": scores[i],
                    **({"text": documents[i]} if body.return_text else {}),
                }
                for i in order[: body.top_n]
            ]
        )
    results: list[dict[str, Any]] = []
    for i in order[: body.top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return web.json_response(
        {
            "id": f"rerank-{uuid.uuid4().hex[:24]}",
            "object": "list",
            "model": body.model,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


for _path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
    routes.post(_path)(rerank)
