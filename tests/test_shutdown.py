"""Graceful shutdown: in-flight streams finish within the grace period, then the tree
stops in reverse order."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from barrel.actors.supervisor import ChildSpec, SupervisorEnv, SupFlags, supervisor_spec
from barrel.config import Config
from barrel.daemon import run_server
from tests.apps import app_for
from tests.daemon import free_port
from tests.probes import Probe, worker


def app_with_stream(probe: Probe, chunks: int, started: asyncio.Event) -> web.Application:
    def tree(env: SupervisorEnv) -> ChildSpec:
        children = [ChildSpec(n, worker(probe)) for n in ("a", "b")]
        return supervisor_spec("root", SupFlags(), children, env)

    app = app_for(Config(), tree=tree)

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        started.set()
        try:
            for i in range(chunks):
                await resp.write(f"chunk {i}\n".encode())
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            probe.record("stream_cancelled")
            raise
        await resp.write_eof()
        return resp

    app.router.add_get("/stream", stream)
    return app


async def open_stream(http: aiohttp.ClientSession, port: int) -> aiohttp.ClientResponse:
    """GET /stream once the server listens (it starts in a task of its own)."""
    for _ in range(100):
        try:
            return await http.get(f"http://127.0.0.1:{port}/stream")
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    raise AssertionError("the server never listened")


async def test_in_flight_stream_finishes_before_the_tree_stops() -> None:
    probe, started, stop = Probe(), asyncio.Event(), asyncio.Event()
    port = free_port()
    server = asyncio.create_task(
        run_server(app_with_stream(probe, 8, started), "127.0.0.1", port, 5.0, stop)
    )
    async with aiohttp.ClientSession() as http:
        resp = await open_stream(http, port)
        await started.wait()
        stop.set()
        body = await resp.text()
    assert body.splitlines() == [f"chunk {i}" for i in range(8)]
    assert await asyncio.wait_for(server, 10) is True
    assert probe.of("stop") == [("stop", "b", "normal"), ("stop", "a", "normal")]
    assert probe.of("stream_cancelled") == []
    async with aiohttp.ClientSession() as http:
        try:
            await http.get(f"http://127.0.0.1:{port}/health")
            raise AssertionError("the server still accepts connections after stopping")
        except aiohttp.ClientConnectionError:
            pass


async def test_stream_longer_than_the_grace_period_is_cancelled() -> None:
    probe, started, stop = Probe(), asyncio.Event(), asyncio.Event()
    port = free_port()
    server = asyncio.create_task(
        run_server(app_with_stream(probe, 1000, started), "127.0.0.1", port, 0.5, stop)
    )
    async with aiohttp.ClientSession() as http:
        resp = await open_stream(http, port)
        await started.wait()
        loop = asyncio.get_running_loop()
        begun = loop.time()
        stop.set()
        assert await asyncio.wait_for(server, 10) is True
        assert loop.time() - begun < 5
        resp.close()
    assert probe.of("stream_cancelled") == [("stream_cancelled",)]
    assert probe.of("stop") == [("stop", "b", "normal"), ("stop", "a", "normal")]
