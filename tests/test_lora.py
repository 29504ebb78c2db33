"""LoRA adapters: a Modelfile ADAPTER applied at load, and llama-server's per-request
`lora` field choosing the scales of one loaded model's adapters — sequences of different
scales in one engine, never in one decode step, never sharing KV cells."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from barrel.engine.context import LoraAdapter
from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, EngineRequest
from barrel.store.synthetic import write_tiny_lora
from tests.daemon import Daemon, serve_models


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora.gguf")


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


async def _alone(
    model: LlamaModel, loras: tuple[LoraAdapter, ...], prompt: list[int]
) -> tuple[int, ...]:
    e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=1, loras=loras)).start()
    try:
        _, done = await e.submit(EngineRequest(prompt, GREEDY, max_tokens=24)).collect()
        return done.tokens
    finally:
        await asyncio.to_thread(e.stop)


async def test_per_request_scales_in_one_engine_match_engines_of_their_own(
    model: LlamaModel, lora: Path
) -> None:
    prompt = model.tokenize("Hello world")
    base = await _alone(model, (), prompt)
    adapted = await _alone(model, (LoraAdapter(lora, 1.0),), prompt)
    half = await _alone(model, (LoraAdapter(lora, 0.5),), prompt)
    assert len({base, adapted, half}) == 3
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=4, loras=(LoraAdapter(lora),)))
    e.start()
    try:
        runs = [
            e.submit(EngineRequest(prompt, GREEDY, max_tokens=24, lora=scales)).collect()
            for scales in (None, (0.0,), (0.5,), (1.0,))
        ]
        outputs = [done.tokens for _, done in await asyncio.gather(*runs)]
        assert outputs == [adapted, base, half, adapted]  # concurrently, each its own
    finally:
        await asyncio.to_thread(e.stop)


async def test_kv_cells_are_not_shared_across_scales(model: LlamaModel, lora: Path) -> None:
    prompt = model.tokenize("The same prompt under two adapters " * 4)
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=2, loras=(LoraAdapter(lora),)))
    e.start()
    try:

        async def reused(scales: tuple[float, ...] | None) -> int:
            request = EngineRequest(prompt, GREEDY, max_tokens=2, lora=scales)
            _, done = await e.submit(request).collect()
            return done.usage.prompt_reused

        assert await reused((0.0,)) == 0
        assert await reused(None) == 0  # the base's cells are not the adapter's
        # whole, with the logits each scope's own prefill left
        assert await reused((0.0,)) == len(prompt)
        assert await reused((1.0,)) == len(prompt)  # the load-time scales: the same
    finally:
        await asyncio.to_thread(e.stop)


async def test_bad_scales_are_refused_before_queueing(model: LlamaModel, lora: Path) -> None:
    from barrel.errors import InvalidRequest

    e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=1, loras=(LoraAdapter(lora),)))
    e.start()
    try:
        prompt = model.tokenize("Hi")
        for scales in ((1.0, 1.0), (float("nan"),), (1e9,)):
            with pytest.raises(InvalidRequest):
                e.submit(EngineRequest(prompt, GREEDY, max_tokens=2, lora=scales))
        # a client choosing a new setting each time leaves no trail behind in the engine
        for i in range(40):
            request = EngineRequest(prompt, GREEDY, max_tokens=2, lora=(i / 40,))
            await e.submit(request).collect()
        assert len(e.loras.served) <= 2
    finally:
        await asyncio.to_thread(e.stop)


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, lora: Path
) -> Iterator[Daemon]:
    d = serve_models(tmp_path_factory.mktemp("lora-daemon"), {"tiny": tiny_path})
    try:
        data = lora.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        r = httpx.post(f"{d.url}/api/blobs/{digest}", content=data, timeout=60)
        assert r.status_code in (200, 201), r.text
        r = httpx.post(
            d.url + "/api/create",
            json={
                "model": "tiny-lora",
                "from": "tiny",
                "adapters": {"tiny-lora.gguf": digest},
                "stream": False,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
    except BaseException:
        d.kill()
        raise
    yield d
    d.kill()


def _chat(daemon: Daemon, model: str, **extra: object) -> str:
    r = httpx.post(
        daemon.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "temperature": 0,
            "max_tokens": 12,
            **extra,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert isinstance(content, str)
    return content


def test_an_adapter_model_and_its_base_answer_differently_at_once(
    daemon: Daemon, lora: Path
) -> None:
    shown = httpx.post(daemon.url + "/api/show", json={"model": "tiny-lora"}, timeout=30)
    adapters = [ln for ln in shown.json()["modelfile"].splitlines() if ln.startswith("ADAPTER ")]
    assert len(adapters) == 1  # /api/show lists the adapter (its blob, as Ollama does)
    assert adapters[0].endswith("sha256-" + hashlib.sha256(lora.read_bytes()).hexdigest())
    base = _chat(daemon, "tiny")
    with ThreadPoolExecutor(3) as pool:  # concurrent requests on one engine
        asked = [
            pool.submit(_chat, daemon, "tiny-lora"),
            pool.submit(_chat, daemon, "tiny-lora", lora=[{"id": 0, "scale": 0.0}]),
            pool.submit(_chat, daemon, "tiny-lora", lora=[]),  # unnamed adapters: 0
        ]
        adapted, zero, none = [f.result(timeout=120) for f in asked]
    assert adapted != base  # the ADAPTER was applied at load
    assert zero == none == base  # scale 0: the base model's answer, from one engine


def test_a_bad_lora_field_is_a_400(daemon: Daemon) -> None:
    for lora, message in (
        ([{"id": 3, "scale": 1.0}], "no adapter 3"),
        ([{"scale": 1.0}], "id"),
        ("all", "lora"),
    ):
        r = httpx.post(
            daemon.url + "/v1/chat/completions",
            json={
                "model": "tiny-lora",
                "messages": [{"role": "user", "content": "Hi"}],
                "lora": lora,
            },
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
