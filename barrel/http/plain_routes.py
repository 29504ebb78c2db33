"""What OpenAI's endpoints outside the generation path share (tokenizing, embeddings,
reranking): reading the body, and a session outside the model's queue."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from aiohttp import web

from barrel.http.codecs.openai_common import decode_json
from barrel.http.keys import MODELS

B = TypeVar("B", bound=msgspec.Struct)


async def decode(request: web.Request, kind: type[B]) -> B:
    return decode_json(await request.read(), kind)


def unqueued(request: web.Request, model: str) -> Any:
    """A session outside the model's queue (tokenizing does not wait behind generation)."""
    return request.app[MODELS].open(model, queued=False)
