"""Sampling defaults belong to the dialect and the model (guides/pipeline.md): the
request's fields over the stored PARAMETERs over the GGUF's recommendation (not for
Ollama) over the dialect's documented defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from barrel.config import decode
from barrel.pipeline.request import Dialect
from barrel.pipeline.sampling import DEFAULTS, effective, recommended
from barrel.store.synthetic import TinyShape, tiny_model
from tests.apps import app_for, booted

RECOMMENDS = (("temp", 0.6), ("top_k", 20), ("min_p", 0.02))


def test_the_openai_and_anthropic_defaults_are_their_apis_not_ollamas() -> None:
    for dialect in (Dialect.OPENAI, Dialect.ANTHROPIC):
        d = DEFAULTS[dialect]
        assert (d["temperature"], d["top_p"], d["top_k"]) == (1.0, 1.0, 0)
        assert (d["repeat_penalty"], d["presence_penalty"], d["frequency_penalty"]) == (1, 0, 0)
    o = DEFAULTS[Dialect.OLLAMA]
    assert (o["temperature"], o["top_k"], o["top_p"], o["repeat_penalty"]) == (0.8, 40, 0.9, 1.1)


def test_the_order_of_precedence() -> None:
    gguf = recommended({"general.sampling.temp": "0.6", "general.sampling.top_k": "20"})
    assert gguf == {"temperature": 0.6, "top_k": 20}
    stored = {"top_p": 0.7}
    asked = {"seed": 3}
    openai = effective(Dialect.OPENAI, asked, stored, gguf)
    assert (openai["temperature"], openai["top_k"], openai["top_p"]) == (0.6, 20, 0.7)
    assert openai["repeat_penalty"] == 1.0
    assert openai["seed"] == 3
    ollama = effective(Dialect.OLLAMA, asked, stored, gguf)
    assert (ollama["temperature"], ollama["top_k"], ollama["top_p"]) == (0.8, 40, 0.7)
    assert ollama["repeat_penalty"] == 1.1
    mine = effective(Dialect.ANTHROPIC, {"temperature": 0.1, "top_k": 5}, stored, gguf)
    assert (mine["temperature"], mine["top_k"]) == (0.1, 5)
    assert recommended({"general.sampling.temp": "warm"}) == {}  # malformed: ignored


@pytest.fixture
def recommending_model() -> Path:
    return tiny_model(TinyShape(sampling=RECOMMENDS))


async def test_each_dialect_samples_with_its_own_defaults_on_a_live_model(
    aiohttp_client: Any, tmp_path: Path, recommending_model: Path
) -> None:
    """A model whose GGUF recommends temp 0.6 / top_k 20 / min_p 0.02, created in the
    store with PARAMETER top_p 0.7: what a request of each dialect that sets only its
    seed samples with, read from the session every handler asks."""
    import shutil

    imports = tmp_path / "imports"
    imports.mkdir()
    shutil.copy(recommending_model, imports / "rec.gguf")
    config = decode(f'[models]\ncache_root = "{tmp_path / "cache"}"\nimport_dir = "{imports}"\n')
    client = await aiohttp_client(app_for(config))
    models = (await booted(client.server.app)).models
    created = await client.post(
        "/api/create",
        json={"model": "rec", "from": "rec.gguf", "parameters": {"top_p": 0.7}, "stream": False},
    )
    assert created.status == 200, await created.text()
    seen = {}
    async with models.open("rec") as session:
        for dialect in DEFAULTS:  # the dialects that generate
            sampling, _, _ = session.sampling(dialect, {"seed": 7})
            seen[dialect] = sampling
    for dialect in (Dialect.OPENAI, Dialect.ANTHROPIC):
        s = seen[dialect]
        assert s.temperature == pytest.approx(0.6)
        assert (s.top_k, s.top_p, s.repeat_penalty, s.seed) == (20, pytest.approx(0.7), 1.0, 7)
        assert s.min_p == pytest.approx(0.02)
    s = seen[Dialect.OLLAMA]
    assert (s.temperature, s.top_k, s.top_p, s.repeat_penalty) == (
        pytest.approx(0.8),
        40,
        pytest.approx(0.7),
        pytest.approx(1.1),
    )
    assert s.min_p == 0.0
