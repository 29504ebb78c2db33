"""Speculative decoding with a draft model (barrel.engine.draft): the output is the one
the model gives without it, greedy and seeded alike, and the acceptance counts move."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.errors import ModelLoadError
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, Done, EngineRequest
from tests.daemon import Daemon, serve_models


class Observer:
    def __init__(self) -> None:
        self.drafts = 0
        self.kept = 0

    def drafted(self, drafted: int, accepted: int) -> None:
        self.drafts += drafted
        self.kept += accepted

    def step(self, *args: object) -> None: ...

    def first_token(self, *args: object) -> None: ...

    def inter_token(self, *args: object) -> None: ...

    def finished(self, *args: object) -> None: ...

    def occupancy(self, *args: object) -> None: ...

    def next_turn(self, *args: object) -> None: ...

    def forced(self, *args: object) -> None: ...


PROMPTS = (
    "<|im_start|>user\nWrite a Python function that adds two numbers.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nList three colours.<|im_end|>\n<|im_start|>assistant\n",
)


async def _answers(
    target: Path, draft: Path | None, requests: list[EngineRequest]
) -> tuple[list[Done], Observer]:
    model = LlamaModel.load(target)
    observer = Observer()
    opts = EngineOptions(n_ctx=1024, n_seq_max=2, speculation="off", draft_model=draft)
    engine = Engine(model, opts, observer=observer).start()
    try:
        results = await asyncio.gather(*(engine.submit(r).collect() for r in requests))
        return [done for _, done in results], observer
    finally:
        await asyncio.to_thread(engine.stop)
        model.free()


def _requests(model_path: Path, n: int) -> list[EngineRequest]:
    vocab = LlamaModel.load(model_path)
    try:
        prompts = [vocab.tokenize(p) for p in PROMPTS]
    finally:
        vocab.free()
    seeded = msgspec.structs.replace(GREEDY, temperature=0.8, seed=7)
    return [
        EngineRequest(prompts[0], GREEDY, max_tokens=n),
        EngineRequest(prompts[1], seeded, max_tokens=n),
    ]


async def test_the_same_model_as_its_own_draft_keeps_every_greedy_guess(tiny_path: Path) -> None:
    requests = _requests(tiny_path, 40)
    plain, none = await _answers(tiny_path, None, requests)
    drafted, seen = await _answers(tiny_path, tiny_path, requests)
    assert [d.tokens for d in drafted] == [d.tokens for d in plain]  # greedy and seeded
    assert none.drafts == 0
    assert 0 < seen.kept < seen.drafts  # the seeded sequence samples other tokens
    greedy, alone = await _answers(tiny_path, tiny_path, requests[:1])
    assert greedy[0].tokens == plain[0].tokens
    assert alone.drafts >= 30
    assert alone.kept == alone.drafts  # its own greedy guesses are always right


async def test_qwen_with_the_tiny_model_as_draft_answers_the_same(
    qwen_path: Path, tiny_path: Path
) -> None:
    requests = _requests(qwen_path, 24)
    plain, _ = await _answers(qwen_path, None, requests)
    drafted, seen = await _answers(qwen_path, tiny_path, requests)
    assert [d.tokens for d in drafted] == [d.tokens for d in plain]
    assert seen.drafts > 0
    assert seen.kept < seen.drafts  # a random draft model guesses badly: still correct


async def test_a_draft_of_another_vocabulary_is_refused(gemma_path: Path, tiny_path: Path) -> None:
    model = LlamaModel.load(tiny_path)
    try:
        with pytest.raises(ModelLoadError, match="vocabulary"):
            Engine(model, EngineOptions(n_ctx=256, n_seq_max=1, draft_model=gemma_path))
    finally:
        model.free()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[Daemon]:
    config = 'drafts = { tiny = "tiny-draft" }\n[models.defaults]\nspeculation = "off"\n'
    d = serve_models(
        tmp_path_factory.mktemp("drafts"), {"tiny": tiny_path, "tiny-draft": tiny_path}, config
    )
    yield d
    d.kill()


def _metric(daemon: Daemon, name: str, model: str) -> float:
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    found = re.search(rf'^{name}_total\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_configured_draft_model_drafts_and_a_modelfile_names_one(daemon: Daemon) -> None:
    def chat(model: str) -> str:
        r = httpx.post(
            daemon.url + "/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Say something."}],
                "temperature": 0,
                "max_tokens": 32,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    answer = chat("tiny")
    drafted = _metric(daemon, "barrel_engine_draft_tokens", "tiny")
    assert drafted > 0  # the acceptance metric per model moves
    assert _metric(daemon, "barrel_engine_draft_accepted_tokens", "tiny") == drafted
    assert chat("tiny-draft") == answer  # the same file without a draft: the same answer
    assert _metric(daemon, "barrel_engine_draft_tokens", "tiny-draft") == 0

    r = httpx.post(
        daemon.url + "/api/create",
        json={
            "model": "tiny-spec",
            "modelfile": "FROM tiny\nPARAMETER draft_model tiny-draft\n",
            "stream": False,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    shown = httpx.post(daemon.url + "/api/show", json={"model": "tiny-spec"}, timeout=30).json()
    assert "draft_model" in shown["parameters"]
    assert chat("tiny-spec") == answer
    assert _metric(daemon, "barrel_engine_draft_tokens", "tiny-spec:latest") > 0
