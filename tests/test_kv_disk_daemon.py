"""Conversations that survive unload and restart, through the daemon: a chat's next turn
after `keep_alive: 0` and after a restart restores the conversation's KV from disk
(cached_tokens says so) and answers as the warm model did; /api/status, `barrel top` and
the metrics show the states; deleting a model removes them. Real daemon, real models,
the official SDKs."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import openai
import pytest
from rich.console import Console

from barrel.cli.top import render_status
from barrel.engine.kvdisk import KVDisk, Saved
from tests.daemon import Daemon, serve_models


def _start(tmp: Path, models: dict[str, Path]) -> Daemon:
    return serve_models(tmp, models, config="kv_states_bytes = 1073741824", context=2048)


@pytest.fixture(scope="module")
def models(qwen_path: Path, tiny_path: Path) -> dict[str, Path]:
    return {"qwen": qwen_path, "tiny": tiny_path}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvdaemon")


@pytest.fixture(scope="module")
def daemon(home: Path, models: dict[str, Path]) -> Iterator[Daemon]:
    d = _start(home, models)
    yield d
    d.kill()


def _story(seed: int) -> str:
    rng = np.random.default_rng(seed)
    items = ", ".join(f"item {int(x)} costs {int(y)}" for x, y in rng.integers(0, 999, (60, 2)))
    return f"Here is a price list: {items}. Remember it."


def _chat(url: str, model: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached prompt tokens), greedy."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300)
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=12,  # type: ignore[arg-type]
    )
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    return r.choices[0].message.content or "", r.usage.prompt_tokens, cached


def _conversation(url: str, model: str, seed: int) -> tuple[list[dict[str, str]], str]:
    """A two-turn chat: the second turn's messages and its warm answer."""
    messages = [{"role": "user", "content": _story(seed)}]
    first, _, _ = _chat(url, model, messages)
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Which item costs the most?"},
    ]
    warm, prompt, cached = _chat(url, model, messages)
    assert cached > prompt // 2  # the first turn's KV, warm
    return messages, warm


def _unload(url: str, model: str) -> None:
    client = ollama.Client(host=url, timeout=300)
    assert client.generate(model=model, prompt="", keep_alive=0).done_reason == "unload"
    assert model not in {m.model for m in client.ps().models}


def _status(url: str) -> dict[str, object]:
    return dict(httpx.get(url + "/api/status", timeout=30).json())


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_the_next_turn_after_an_unload_restores_the_conversation(
    daemon: Daemon, model: str
) -> None:
    messages, warm = _conversation(daemon.url, model, seed=1 if model == "tiny" else 2)
    _unload(daemon.url, model)
    states = {s["model"]: s for s in _status(daemon.url)["kv_states"]}  # type: ignore[attr-defined]
    assert states[model]["states"] >= 1
    assert states[model]["bytes"] > 0
    answer, prompt, cached = _chat(daemon.url, model, messages)
    assert cached == prompt - 1  # all but the last prompt token from disk
    assert answer == warm
    metrics = httpx.get(daemon.url + "/metrics", timeout=30).text
    m = re.search(rf'barrel_engine_restored_tokens_total{{model="{model}"}} (\S+)', metrics)
    assert m is not None
    assert float(m.group(1)) >= prompt - 1


def test_the_next_turn_after_a_restart_restores_the_conversation(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    d = _start(tmp_path, models)
    try:
        chats = {name: _conversation(d.url, name, seed=3) for name in ("tiny", "qwen")}
        d.signal(signal.SIGTERM)  # a clean stop: the engines write their states
        assert d.wait(120) == 0
    finally:
        d.kill()
    d = _start(tmp_path, models)
    try:
        status = _status(d.url)
        after = {name: _chat(d.url, name, messages) for name, (messages, _) in chats.items()}
    finally:
        d.kill()
    for name, (answer, prompt, cached) in after.items():
        assert cached == prompt - 1, name
        assert answer == chats[name][1], name
    assert [s["model"] for s in status["kv_states"]] == ["qwen", "tiny"]  # type: ignore[attr-defined]
    console = Console(record=True, width=160)
    console.print(render_status(status))
    text = console.export_text()
    assert re.search(r"Saved conversations: qwen \d+ \(\d.*\), tiny \d+ \(", text), text


def test_prune_and_delete_remove_the_states_of_models_gone(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    # a state left by a model no longer registered
    old = KVDisk(tmp_path / "cache" / "kv-states", 1 << 30)
    assert old.write("gone", "fp", "sha256:gone", Saved("", tuple(range(300)), b"x" * 1000))
    d = _start(tmp_path, {"tiny": models["tiny"]})
    try:
        client = ollama.Client(host=d.url, timeout=60)
        client.copy("tiny", "mine")  # a store model: deleting it is the daemon's to do
        name = next(m.model for m in client.list().models if m.model.startswith("mine"))
        _conversation(d.url, name, seed=4)
        _unload(d.url, name)

        def saved() -> list[str]:
            return [s["model"] for s in _status(d.url)["kv_states"]]  # type: ignore[attr-defined]

        assert saved() == ["gone", name]
        assert httpx.post(d.url + "/api/prune", json={}, timeout=60).status_code == 200
        assert saved() == [name]
        client.delete(name)
        assert saved() == []
        files = list((tmp_path / "cache" / "kv-states").glob("*"))
    finally:
        d.kill()
    assert files == []
