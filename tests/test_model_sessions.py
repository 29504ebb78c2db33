"""A model session is valid only while its lease is held: use after release is a clear
error, and an unload never frees the vocabulary under a tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from barrel.actors.model_session import SessionClosed
from barrel.config import decode
from barrel.engine.model import LlamaModel, ModelOptions
from tests.apps import app_for, booted
from tests.daemon import serve_models


def test_a_held_model_is_freed_only_when_the_last_holder_lets_go(tiny_path: Path) -> None:
    model = LlamaModel.load(tiny_path, ModelOptions(vocab_only=True))
    words = model.tokenize("Hello world")
    assert model.retain()
    model.free()  # an unload: the holder still tokenizes safely
    assert model.freed
    assert not model.retain()  # nobody new gets it
    assert model.tokenize("Hello world") == words
    model.release()  # the last holder: freed now
    assert model._freed


async def test_a_session_used_after_its_release_raises(
    aiohttp_client: Any, tmp_path: Path, tiny_path: Path
) -> None:
    config = decode(f'[models]\ncache_root = "{tmp_path}"\n')
    client = await aiohttp_client(app_for(config, local_models={"tiny": str(tiny_path)}))
    models = (await booted(client.server.app)).models
    async with models.open("tiny", queued=False) as session:
        ids = session.tokenize("Hello world")
        assert session.detokenize(ids).strip() == "Hello world"
    for use in (
        lambda: session.tokenize("x"),
        lambda: session.detokenize(ids),
        lambda: session.piece(ids[0]),
        lambda: session.n_vocab,
    ):
        with pytest.raises(SessionClosed, match="used after its release"):
            use()
    with pytest.raises(SessionClosed):
        await session.template()


async def test_a_generation_session_is_expected_by_its_engine_until_it_closes(
    aiohttp_client: Any, tmp_path: Path, tiny_path: Path
) -> None:
    """An idle engine holds its first step only for open sessions that will generate
    (Engine.expect): a tokenizing session is not one, and a closed one no longer is."""
    config = decode(f'[models]\ncache_root = "{tmp_path}"\n')
    client = await aiohttp_client(app_for(config, local_models={"tiny": str(tiny_path)}))
    models = (await booted(client.server.app)).models
    async with models.open("tiny", queued=False) as tokenizing:
        engine = tokenizing._engine
        assert engine.expected == 0
        async with models.open("tiny") as first, models.open("tiny", sequences=2) as second:
            assert engine.expected == 3  # n = 2: two sequences of one request
            assert second is not first
        assert engine.expected == 0
    seen = []

    async def failing_handler() -> None:
        async with models.open("tiny"):
            seen.append(engine.expected)
            raise RuntimeError("the handler failed before submitting")

    with pytest.raises(RuntimeError):
        await failing_handler()
    assert seen == [1]
    assert engine.expected == 0


# long enough that each answer spends a while in the vocabulary (pieces included)
TEXT = " ".join(f"word{i} ünïcode {i * 7919}" for i in range(600))


async def _tokenize_round(
    http: aiohttp.ClientSession, url: str, ids: list[int], rounds: int, served: asyncio.Event
) -> list[str]:
    """Tokenize and detokenize (with pieces) while nothing else is guaranteed: each answer
    is right, or a clear 503 in OpenAI's envelope."""

    async def tok() -> str:
        body = {"model": "tiny", "content": TEXT, "with_pieces": True}
        async with http.post(url + "/tokenize", json=body) as r:
            data = await r.json()
            if r.status == 200:
                assert [t["id"] for t in data["tokens"]] == ids
                assert "".join(t["piece"] for t in data["tokens"]) == TEXT
                served.set()
                return "ok"
            assert r.status == 503, data
            assert data["error"]["code"] in ("engine_stopped", "unavailable"), data
            return "503"

    async def detok() -> str:
        async with http.post(url + "/detokenize", json={"model": "tiny", "tokens": ids}) as r:
            data = await r.json()
            if r.status == 200:
                assert data["content"] == TEXT
                served.set()
                return "ok"
            assert r.status == 503, data
            return "503"

    return [await (tok() if i % 2 else detok()) for i in range(rounds)]


async def _unload_loop(
    http: aiohttp.ClientSession, url: str, served: asyncio.Event, stop: asyncio.Event
) -> int:
    """Unload (Ollama's keep_alive 0) after every answer served, until told to stop: each
    unload lands among requests in flight."""
    n = 0
    while not stop.is_set():
        await served.wait()
        served.clear()
        async with http.post(url + "/api/generate", json={"model": "tiny", "keep_alive": 0}) as r:
            assert r.status == 200, await r.text()
        n += 1
    return n


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
async def test_tokenizing_while_the_model_is_unloaded_in_a_loop(
    tmp_path: Path, tiny_path: Path
) -> None:
    daemon = serve_models(tmp_path, {"tiny": tiny_path})
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = {"model": "tiny", "content": TEXT}
            async with http.post(daemon.url + "/tokenize", json=body) as r:
                ids = (await r.json())["tokens"]
            stop, served = asyncio.Event(), asyncio.Event()
            unloads = asyncio.create_task(_unload_loop(http, daemon.url, served, stop))
            rounds = [_tokenize_round(http, daemon.url, ids, 20, served) for _ in range(4)]
            outcomes = [o for batch in await asyncio.gather(*rounds) for o in batch]
            stop.set()
            served.set()
            n_unloads = await unloads
            assert n_unloads > 10, n_unloads
            assert daemon.proc.poll() is None, daemon.output()
            assert outcomes.count("ok") > 0
            async with http.post(daemon.url + "/tokenize", json=body) as r:
                assert (await r.json())["tokens"] == ids
    finally:
        daemon.kill()
