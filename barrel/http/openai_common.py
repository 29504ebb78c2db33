"""What OpenAI's endpoints outside the chat codec share (completions, tokenizing,
embeddings): reading the body, the sampling of raw completions, a session with SSE
comments while waiting, and the error frame of a stream that fails after it began."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from barrel.actors.model_session import ModelSession
from barrel.errors import BarrelError
from barrel.http.codecs.openai_common import (
    Knobs,
    decode_json,
    error_frame,
    logit_bias_of,
    options_of,
    progress,
)
from barrel.http.keys import MODELS
from barrel.http.sse import SseWriter
from barrel.pipeline.sampling import Dialect
from barrel.pipeline.types import SamplingParams

logger = logging.getLogger(__name__)

B = TypeVar("B", bound=msgspec.Struct)


async def decode(request: web.Request, kind: type[B]) -> B:
    return decode_json(await request.read(), kind)


def sampling_for(
    k: Knobs, session: ModelSession, logprobs: int | None
) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    """The request's knobs over the model's (stored, then recommended) parameters over
    OpenAI's defaults; and the token limit and stop strings."""
    sampling, predict, stop = session.sampling(Dialect.OPENAI, options_of(k).given())
    bias = logit_bias_of(k)
    if bias:
        session.check_tokens(list(bias), "logit_bias")
        sampling = msgspec.structs.replace(sampling, logit_bias=bias)
    if logprobs is not None:
        sampling = msgspec.structs.replace(sampling, logprobs=logprobs)
    return sampling, (k.max_tokens if k.max_tokens is not None else predict), stop


def _progress(sse: SseWriter | None) -> tuple[Callable[[int], None], Callable[[float], None]]:
    if sse is None:
        return (lambda _: None), (lambda _: None)
    return (
        lambda pos: sse.soon(sse.comment(progress(pos, None)[0].text)),
        lambda s: sse.soon(sse.comment(progress(None, s)[0].text)),
    )


@asynccontextmanager
async def leased(
    request: web.Request, model: str, sse: SseWriter | None, sequences: int = 1
) -> AsyncIterator[ModelSession]:
    """A session on `model` for `sequences` engine sequences; a stream hears SSE comments
    while it waits in the queue or for the load."""
    on_queued, on_loading = _progress(sse)
    async with request.app[MODELS].open(
        model, on_queued=on_queued, on_loading=on_loading, sequences=sequences
    ) as session:
        yield session


def unqueued(request: web.Request, model: str) -> Any:
    """A session outside the model's queue (tokenizing does not wait behind generation)."""
    return request.app[MODELS].open(model, queued=False)


async def stream_failed(sse: SseWriter | None, err: BaseException) -> web.StreamResponse:
    """Before anything was sent, the error is a plain response (re-raised for the
    middleware); after, an error frame in OpenAI's envelope, and the stream closes."""
    if sse is not None:
        await sse.settle()
    if sse is None or not sse.started:
        raise err
    if not isinstance(err, BarrelError):
        logger.error("a stream failed", exc_info=err)
        err = BarrelError("internal server error")
    await sse.send(error_frame(err).payload)
    return await sse.close()
