"""Slow work stays off the request path: a multi-GB import hashes in a worker thread
while chat requests for a store model stream on."""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path

import aiohttp
import pytest

from barrel.store.synthetic import write_small_gguf
from tests.daemon import serve_models

BIG = 1_100 << 20  # > 1 GiB of tensor data


async def _ttft(http: aiohttp.ClientSession, url: str) -> float:
    """Seconds to the first generated piece of a streamed chat; the stream must end well."""
    body = {
        "model": "chatty",
        "messages": [{"role": "user", "content": "Hello there"}],
        "options": {"temperature": 0, "num_predict": 8},
    }
    start = time.perf_counter()
    first = 0.0
    async with http.post(url + "/api/chat", json=body) as r:
        assert r.status == 200, await r.text()
        last: dict[str, object] = {}
        async for line in r.content:
            last = json.loads(line)
            assert "error" not in last, last
            if not first:
                first = time.perf_counter() - start
    assert last.get("done") is True
    return first


async def _round(http: aiohttp.ClientSession, url: str) -> list[float]:
    """Times to first token of 15 requests one after the other."""
    return [await _ttft(http, url) for _ in range(15)]


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
async def test_a_large_import_does_not_stall_chat_on_a_store_model(
    tmp_path: Path, tiny_path: Path
) -> None:
    imports = tmp_path / "imports"
    imports.mkdir()
    shutil.copy(tiny_path, imports / "tiny.gguf")
    await asyncio.to_thread(write_small_gguf, imports / "big.gguf", BIG)
    # the big file is a header and padding: what is measured is its hashing, not a load
    daemon = serve_models(tmp_path, {}, f'import_dir = "{imports}"\ntrial_load = false')
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            made = await http.post(
                daemon.url + "/api/create",
                json={"model": "chatty", "from": "tiny.gguf", "stream": False},
            )
            assert made.status == 200, await made.text()
            await _ttft(http, daemon.url)  # loaded
            before = await _round(http, daemon.url)

            async def create_big() -> list[dict[str, str]]:
                body = {"model": "big", "from": "big.gguf"}
                async with http.post(daemon.url + "/api/create", json=body) as r:
                    assert r.status == 200
                    lines = []
                    async for line in r.content:
                        lines.append(json.loads(line))
                        started.set()
                    return lines

            started = asyncio.Event()
            began = time.perf_counter()
            creating = asyncio.create_task(create_big())
            await started.wait()  # the import is under way
            during = await _round(http, daemon.url)
            overlapped = not creating.done()
            lines = await creating
            importing = time.perf_counter() - began
            after = await _round(http, daemon.url)
        assert lines[-1] == {"status": "success"}, lines
        assert overlapped, "the import ended before the chats: make it bigger"
        # typical requests keep their speed, and none waits for the import: a stalled one
        # would wait for the rest of the hashing, seconds (bounds relative to the import
        # itself, so that a busy box's hiccup of a few hundred ms does not count)
        typical = max(statistics.median(before), statistics.median(after))
        assert statistics.median(during) <= 3 * typical, (before, during, after)
        assert max(during) < importing / 4, (during, importing)
        assert daemon.proc.poll() is None
    finally:
        daemon.kill()
