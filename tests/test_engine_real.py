"""The engine on real models: session isolation and KV reuse across turns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import GenerationRequest, SessionId

pytestmark = pytest.mark.real_model

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def chatml(*turns: tuple[str, str]) -> str:
    """Qwen's ChatML by hand (chat templates are the pipeline's business)."""
    text = SYSTEM
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(qwen_path)
    yield m
    m.free()


@pytest.fixture
async def engine(qwen: LlamaModel) -> AsyncIterator[Engine]:
    e = Engine(qwen, EngineOptions(n_ctx=4096, n_seq_max=4), name="qwen").start()
    yield e
    await asyncio.to_thread(e.stop)


MARKERS = ["PELICAN-4417", "TANGERINE-9021", "OBSIDIAN-3360", "MARIGOLD-7784"]


async def test_concurrent_sessions_never_see_each_others_markers(
    engine: Engine, qwen: LlamaModel
) -> None:
    async def ask(session: str, marker: str) -> str:
        prompt = chatml(("user", f"My secret code word is {marker}. Repeat my secret code word."))
        req = GenerationRequest(qwen.tokenize(prompt), max_tokens=24, session=SessionId(session))
        deltas, _ = await engine.submit(req).collect()
        return "".join(d.text for d in deltas)

    # Round two gives every session another session's parked sequence to reuse (they
    # share the system prompt): the reused prefix must not carry the old content.
    for rotation in range(2):
        markers = MARKERS[rotation:] + MARKERS[:rotation]
        answers = await asyncio.gather(*(ask(f"s{i}", m) for i, m in enumerate(markers)))
        for marker, answer in zip(markers, answers, strict=True):
            assert marker in answer, answer
            others = [m for m in MARKERS if m != marker]
            assert not any(o in answer for o in others), (marker, answer)


async def test_second_turn_prefills_only_what_is_new(engine: Engine, qwen: LlamaModel) -> None:
    session = SessionId("conversation")
    question = "Write a Python function that adds two numbers."
    p1 = qwen.tokenize(chatml(("user", question)))
    deltas, done1 = await engine.submit(
        GenerationRequest(p1, max_tokens=48, session=session)
    ).collect()
    reply = "".join(d.text for d in deltas)
    assert done1.usage.prompt_reused == 0
    p2 = qwen.tokenize(chatml(("user", question), ("assistant", reply), ("user", "Now in Rust.")))
    _, done2 = await engine.submit(GenerationRequest(p2, max_tokens=8, session=session)).collect()
    generated = done1.usage.completion_tokens
    # everything of turn one is reused, except the final sampled token (never decoded) and
    # what the template renders differently
    assert done2.usage.prompt_reused >= len(p1) + generated - 2
    assert done2.usage.prompt_computed == len(p2) - done2.usage.prompt_reused
    assert done2.usage.prompt_computed < len(p2) - len(p1)


async def test_sliding_window_model_reuses_only_what_its_window_still_holds(
    gemma_path: Path,
) -> None:
    gemma = LlamaModel.load(gemma_path)
    assert gemma.n_swa == 512
    # One sequence and no pins: the sliding-window layers hold 512 + n_ubatch cells, so a
    # 1,500-token prompt overwrites its own early positions there.
    opts = EngineOptions(n_ctx=2048, n_seq_max=1, max_pins=0, state_cache_bytes=0)
    e = Engine(gemma, opts, name="gemma").start()
    cold = Engine(gemma, opts, name="cold").start()
    tail = gemma.tokenize(" and the last one is", add_special=False)

    async def run(engine: Engine, prompt: list[int]) -> tuple[int, str, tuple[int, ...]]:
        _, done = await engine.submit(GenerationRequest(prompt, max_tokens=6)).collect()
        assert done.usage.prompt_reused + done.usage.prompt_computed == len(prompt)
        return done.usage.prompt_reused, done.usage.reuse_note, done.tokens

    try:
        # within the window, a partial reuse works and gives the cold output
        short = gemma.tokenize("List: " + " ".join(f"item{i}" for i in range(60)))
        await run(e, short)
        reused, note, tokens = await run(e, short[:100] + tail)
        assert (reused, note) == (100, "")
        assert tokens == (await run(cold, short[:100] + tail))[2]
        # past the window, the early positions have left the sliding-window layers:
        # reusing a prefix that ends there would attend to missing cells
        long = gemma.tokenize("List: " + " ".join(f"item{i}" for i in range(400)))
        await run(e, long)
        reused, note, tokens = await run(e, long[:100] + tail)
        assert reused == 0
        assert "sliding-window" in note
    finally:
        e.stop()
        cold.stop()
        gemma.free()
