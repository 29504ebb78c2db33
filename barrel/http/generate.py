"""The one handler body behind every generating endpoint, whatever its dialect.

    req, extras = codec.decode(body)            # 400s, before anything else
    return await serve(request, req, encoder, transport)

`serve` checks the request, opens a model session (its encoder's progress frames go
out while it waits in the queue or for the load), starts the pipeline's one generation
path, feeds every event to the encoder and writes its frames; without streaming it
answers the encoder's full response. A failure before the stream began is re-raised for
the error middleware (a plain status in the dialect's envelope); after, it becomes the
encoder's error frame and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from barrel.actors.tools import key_scope
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import STAMP, Begin, Comment, Data, Encoder, EndMarker, Frame, Stamp
from barrel.http.keys import API_KEY, CONFIG, MODELS
from barrel.http.sse import SseWriter
from barrel.pipeline import audio, generation, images
from barrel.pipeline.request import ApiRequest

logger = logging.getLogger(__name__)


class Transport(Protocol):
    @property
    def started(self) -> bool: ...

    async def write(self, frames: list[Frame]) -> None: ...

    def soon(self, frames: list[Frame]) -> None:
        """Write from a plain callback (queue positions, load progress)."""
        ...

    async def settle(self) -> None: ...

    async def close(self) -> web.StreamResponse: ...


class SseTransport:
    def __init__(self, request: web.Request) -> None:
        self.sse = SseWriter(request)

    @property
    def started(self) -> bool:
        return self.sse.started

    async def _emit(self, frames: list[Frame]) -> None:
        for frame in frames:
            if isinstance(frame, Data):
                await self.sse.send(frame.payload, frame.event)
            elif isinstance(frame, Comment):
                await self.sse.comment(frame.text)
            elif isinstance(frame, EndMarker):
                await self.sse.done()

    async def write(self, frames: list[Frame]) -> None:
        await self.sse.settle()  # progress frames first, in order
        await self._emit(frames)

    def soon(self, frames: list[Frame]) -> None:
        if frames:
            self.sse.soon(self._emit(frames))

    async def settle(self) -> None:
        await self.sse.settle()

    async def close(self) -> web.StreamResponse:
        return await self.sse.close()


class NdjsonTransport:
    """Ollama's streams: one JSON object a line; comments and end markers are not sent."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.resp is not None

    async def write(self, frames: list[Frame]) -> None:
        lines = [_line(f.payload) for f in frames if isinstance(f, Data)]
        if not lines:
            return
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await self.resp.prepare(self.request)
        await self.resp.write(b"".join(lines))

    def soon(self, frames: list[Frame]) -> None:
        pass  # Ollama sends nothing while it waits

    async def settle(self) -> None:
        pass

    async def close(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await self.resp.prepare(self.request)
        await self.resp.write_eof()
        return self.resp


def scope_of(request: web.Request) -> str:
    """The request's KV scope: a hash of the API key it authenticated with ("" when the
    daemon has no keys), so no key reuses, or learns about, another's cached prompts."""
    key = request.get(API_KEY)
    return key_scope(key) if key else ""


# Headers that name a conversation, Barrel's own first, then the ones routers pin a
# session with (SMG's consistent hashing, llm-d and most gateways' session affinity): the
# router's choice of daemon and the daemon's choice of KV sequence follow the same key.
SESSION_HEADERS = ("x-conversation-id", "x-session-id", "x-smg-routing-key")


def conversation_of(request: web.Request) -> str | None:
    """The conversation a request names by header, if any (its KV session key)."""
    for header in SESSION_HEADERS:
        value = request.headers.get(header)
        if value:
            return value
    return None


def _line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"  # as in barrel.http.sse


async def with_media(request: web.Request, req: ApiRequest) -> ApiRequest:
    """`req` with its images' and audio clips' bytes in hand (barrel.pipeline.images,
    .audio). A model without a projector that reads them is a 400 first, before any
    load or download."""
    n_images, n_clips = images.count(req), audio.count(req)
    if not n_images and not n_clips:
        return req
    models = request.app[MODELS]
    shown = await models.manage.show(req.model)
    capabilities = shown.get("capabilities", [])
    if n_images and "vision" not in capabilities:
        raise InvalidRequest(images.REFUSAL)
    if n_clips and "audio" not in capabilities:
        raise InvalidRequest(audio.REFUSAL)
    limits = request.app[CONFIG].limits
    req = await audio.load(req, limits)
    return await images.load(req, limits, models.fetch_image)


async def serve(
    request: web.Request,
    req: ApiRequest,
    encoder: Encoder,
    transport: Transport | None,
    *,
    stamp: Stamp = STAMP,
    finished: Callable[[], Awaitable[None] | None] | None = None,
    reply: Callable[[dict[str, Any]], web.StreamResponse] = web.json_response,
) -> web.StreamResponse:
    """Run `req` and answer it through `encoder` (see the module's docstring).
    `finished()` runs once the generation ended well, before the last frames go out;
    `reply(encoder.full())` is the response when nothing streams."""
    limits = request.app[CONFIG].limits
    generation.check(req, limits)
    req = msgspec.structs.replace(req, scope=scope_of(request))
    tools = request.app[MODELS].tools
    toolbox = tools.grant(req.servers, req.scope)
    req = await with_media(request, req)
    started = stamp.perf()

    def queued(position: int) -> None:
        if transport is not None:
            transport.soon(encoder.waiting(position, None))

    def loading(seconds: float) -> None:
        if transport is not None:
            transport.soon(encoder.waiting(None, seconds))

    try:
        async with request.app[MODELS].open(
            req.model,
            keep_alive=req.keep_alive,
            on_queued=queued,
            on_loading=loading,
            sequences=req.runs,
        ) as session:
            load_s = stamp.perf() - started
            gen = await generation.start(session, req, limits, toolbox, tools.max_rounds)
            begin = Begin(
                gen.prompt_tokens,
                started,
                load_s,
                tuple(gen.prompt),
                gen.echo,
                audio.seconds(req),
            )
            frames = encoder.begin(begin)
            if transport is not None and frames:
                await transport.write(frames)
            async for index, event in merged(gen.runs):
                frames = encoder.feed(index, event)
                if transport is not None and frames:
                    await transport.write(frames)
            frames = encoder.end()
            if finished is not None:
                done = finished()
                if done is not None:
                    await done
            if transport is None:
                return reply(encoder.full())
            await transport.write(frames)
    except ConnectionError:
        raise  # the client went away: nobody to tell
    except Exception as err:
        if transport is not None:
            await transport.settle()
        if transport is None or not transport.started:
            raise
        if not isinstance(err, BarrelError):
            logger.error("a stream failed", exc_info=err)
            err = BarrelError("internal server error")
        await transport.write(encoder.error(err))
    assert transport is not None
    return await transport.close()


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
