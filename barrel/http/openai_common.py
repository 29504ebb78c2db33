"""What OpenAI's generation endpoints share: the body's sampling knobs and their checks,
usage and logprobs in OpenAI's shapes, the model lease with SSE comments while waiting,
and the error frame of a stream that fails after it began."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from barrel.actors.lifecycle import Lease
from barrel.engine.types import SamplingParams, TokenLogprob, Usage
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.errors import Dialect, error_body
from barrel.http.keys import LIFECYCLE
from barrel.http.ollama_gen import sampling_from
from barrel.http.sse import SseWriter

logger = logging.getLogger(__name__)

MAX_N = 8  # choices per request (each one is a sequence of the engine)
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class Knobs(msgspec.Struct, kw_only=True):
    """Fields chat completions, completions and responses have in common. Unknown fields
    are ignored, as OpenAI-compatible servers do (store, metadata, service_tier, ...)."""

    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    # llama-server's extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None


B = TypeVar("B", bound=msgspec.Struct)
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


async def decode(request: web.Request, kind: type[B]) -> B:
    try:
        body = msgspec.json.decode(await request.read() or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _AT.search(text)
        raise InvalidRequest(f"invalid request: {text}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not getattr(body, "model", ""):
        raise InvalidRequest("you must provide a model parameter", param="model")
    return body


def _between(value: float | None, low: float, high: float, param: str) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{param} must be between {low:g} and {high:g}", param=param)


def check_knobs(k: Knobs) -> None:
    """Everything about the knobs that can be checked before a lease."""
    _between(k.temperature, 0.0, 2.0, "temperature")
    _between(k.top_p, 0.0, 1.0, "top_p")
    _between(k.presence_penalty, -2.0, 2.0, "presence_penalty")
    _between(k.frequency_penalty, -2.0, 2.0, "frequency_penalty")
    if not 1 <= k.n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    if k.max_tokens is not None and k.max_tokens < 0:
        raise InvalidRequest("max_tokens must not be negative", param="max_tokens")
    if isinstance(k.stop, list) and len(k.stop) > MAX_STOP:
        raise InvalidRequest(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    for key, bias in (k.logit_bias or {}).items():
        if not key.isdigit():
            raise InvalidRequest(f"logit_bias keys are token ids, not {key!r}", param="logit_bias")
        _between(bias, -100.0, 100.0, "logit_bias")


def sampling_for(
    k: Knobs, lease: Lease, logprobs: int | None
) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    """The request's knobs over the model's stored parameters over the defaults; and the
    token limit and stop strings."""
    names = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repeat_penalty",
        "seed",
        "presence_penalty",
        "frequency_penalty",
    )
    options: dict[str, Any] = {n: getattr(k, n) for n in names if getattr(k, n) is not None}
    if k.stop is not None:
        options["stop"] = [k.stop] if isinstance(k.stop, str) else k.stop
    sampling, predict, stop = sampling_from(options, lease.spec.parameters)
    if k.logit_bias:
        vocab = lease.engine.model.n_vocab
        bias = {int(t): float(b) for t, b in k.logit_bias.items()}
        if any(t >= vocab for t in bias):
            raise InvalidRequest(f"logit_bias: token ids must be below {vocab}", param="logit_bias")
        sampling = msgspec.structs.replace(sampling, logit_bias=bias)
    if logprobs is not None:
        sampling = msgspec.structs.replace(sampling, logprobs=logprobs)
    return sampling, (k.max_tokens if k.max_tokens is not None else predict), stop


def include_usage(k: Knobs) -> bool:
    return bool((k.stream_options or {}).get("include_usage"))


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def usage_of(usages: list[Usage]) -> dict[str, Any]:
    """Usage of one request; with several choices the prompt counts once."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.prompt_reused},
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def token_logprobs(lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat completions' (and responses') logprobs.content entries."""
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "bytes": _bytes(lp.text),
            "top_logprobs": [
                {"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text)} for t in lp.top
            ],
        }
        for lp in lps
    ]


def _progress(sse: SseWriter | None) -> tuple[Callable[[int], None], Callable[[float], None]]:
    if sse is None:
        return (lambda _: None), (lambda _: None)
    return (
        lambda pos: sse.soon(sse.comment(f"queued, position {pos}")),
        lambda s: sse.soon(sse.comment(f"loading the model, {s:.0f}s")),
    )


@asynccontextmanager
async def leased(request: web.Request, model: str, sse: SseWriter | None) -> AsyncIterator[Lease]:
    """A lease on `model`; a stream hears SSE comments while it waits in the queue or for
    the load."""
    lifecycle = request.app[LIFECYCLE]
    on_queued, on_loading = _progress(sse)
    lease = await lifecycle.acquire(model, None, on_queued=on_queued, on_loading=on_loading)
    try:
        yield lease
    finally:
        await lifecycle.release(lease)


@asynccontextmanager
async def unqueued(request: web.Request, model: str) -> AsyncIterator[Lease]:
    """A lease outside the model's queue (tokenizing does not wait behind generation)."""
    lifecycle = request.app[LIFECYCLE]
    lease = await lifecycle.unqueued(model)
    try:
        yield lease
    finally:
        await lifecycle.release(lease)


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
    envelope = error_body(Dialect.OPENAI, err.status, err.code, err.message, err.param)
    assert isinstance(envelope, dict)
    await sse.send(envelope)
    return await sse.close()


T = TypeVar("T")
_END = object()


async def merged(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, with the index of their stream. Leaving
    early (a client went away) closes every stream, which cancels its engine sequence."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=64)

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as s:
                async for item in s:
                    await queue.put((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, exc))
        await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
