"""Server-sent events, prepared lazily: the response starts at the first event, comment or
ping, so an error before any waiting is still a plain HTTP status (404, 503, 529, ...)
and an error after it must travel as an event of the dialect."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

from aiohttp import web


class SseWriter:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def started(self) -> bool:
        return self.resp is not None

    async def _write(self, chunk: bytes) -> None:
        async with self._lock:
            if self.resp is None:
                self.resp = web.StreamResponse(
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                    }
                )
                await self.resp.prepare(self.request)
            await self.resp.write(chunk)

    async def send(self, data: dict[str, Any], event: str | None = None) -> None:
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        head = f"event: {event}\n" if event else ""
        await self._write(f"{head}data: {payload}\n\n".encode())

    async def comment(self, text: str) -> None:
        """A `: text` line: clients skip it; it keeps proxies and readers from timing out."""
        await self._write(f": {text}\n\n".encode())

    async def done(self) -> None:
        """OpenAI's end marker."""
        await self._write(b"data: [DONE]\n\n")

    def soon(self, write: Awaitable[None]) -> None:
        """Write from a plain callback (queue positions, load progress)."""
        task = asyncio.ensure_future(write)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self) -> None:
        """Wait for the writes `soon` started, so none lands after the body."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def close(self) -> web.StreamResponse:
        await self.settle()
        if self.resp is None:  # nothing was ever written: an empty stream
            await self._write(b"")
        assert self.resp is not None
        await self.resp.write_eof()
        return self.resp
