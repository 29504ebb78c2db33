"""The engine on real models: session isolation and KV reuse across turns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import EngineRequest, SamplingParams, SessionId
from barrel.pipeline.formats import format_grammar
from barrel.pipeline.request import Format

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


@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "per-sequence"])
async def test_concurrent_sessions_never_see_each_others_markers(
    qwen: LlamaModel, per_sequence: bool
) -> None:
    """With a KV stream per sequence the second round once gave a session "\n": its
    prefix was copied from another stream (llama.cpp queues a cross-stream copy for the
    next decode) and, in the same admission pass, that stream took a state restored from
    the state cache, which the queued copy then carried over. Such copies are made at
    once now (`SlotManager._copy_now`)."""
    opts = EngineOptions(n_ctx=4096, n_seq_max=4, kv_per_sequence=per_sequence)
    engine = Engine(qwen, opts, name="qwen").start()
    try:
        await _markers(engine, qwen)
    finally:
        await asyncio.to_thread(engine.stop)


async def _markers(engine: Engine, qwen: LlamaModel) -> None:
    async def ask(session: str, marker: str) -> str:
        prompt = chatml(("user", f"My secret code word is {marker}. Repeat my secret code word."))
        req = EngineRequest(qwen.tokenize(prompt), max_tokens=24, session=SessionId(session))
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
    deltas, done1 = await engine.submit(EngineRequest(p1, max_tokens=48, session=session)).collect()
    reply = "".join(d.text for d in deltas)
    assert done1.usage.prompt_reused == 0
    p2 = qwen.tokenize(chatml(("user", question), ("assistant", reply), ("user", "Now in Rust.")))
    _, done2 = await engine.submit(EngineRequest(p2, max_tokens=8, session=session)).collect()
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
        _, done = await engine.submit(EngineRequest(prompt, max_tokens=6)).collect()
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


def ledger(k: int) -> str:
    """A ~180-token ChatML prompt; on this box's CPU kernels the answers to k = 6, 7 and
    15 changed when the prompt's last token was decoded again alone (bench.invariance)."""
    notes = " ".join(f"Fact {k}.{i}: item {i} costs {i * 3 + k} coins." for i in range(10))
    return (
        f"<|im_start|>system\nYou keep a ledger. {notes}<|im_end|>\n"
        "<|im_start|>user\nList items 5 to 9 with their costs.<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_a_repeated_prompt_starts_from_the_logits_its_prefill_left(
    qwen: LlamaModel,
) -> None:
    """The same prompt asked again runs no prefill step: its first token is sampled from
    the logits the first request's prefill left with the slot, so a greedy answer is the
    one a cold run gives (decoding the last prompt token alone rounds differently, and
    near ties flipped)."""
    e = Engine(qwen, EngineOptions(n_ctx=4096, n_seq_max=4, speculation="off")).start()
    try:
        for k in (0, 6, 7, 15):
            prompt = qwen.tokenize(ledger(k), add_special=False)
            cold_steps = e.steps
            _, cold = await e.submit(EngineRequest(prompt, max_tokens=24)).collect()
            again_steps = e.steps
            _, again = await e.submit(EngineRequest(prompt, max_tokens=24)).collect()
            assert (again.usage.prompt_reused, again.usage.prompt_computed) == (len(prompt), 0)
            assert again.tokens == cold.tokens, k
            # one prefill step, then a step for each generated token but the last
            assert again_steps - cold_steps == len(cold.tokens)
            assert e.steps - again_steps == len(again.tokens) - 1
        # A shorter prompt the slot also holds has no logits kept: its last token is decoded.
        _, part = await e.submit(EngineRequest(prompt[:-3], max_tokens=2)).collect()
        assert (part.usage.prompt_reused, part.usage.prompt_computed) == (len(prompt) - 4, 1)
    finally:
        await asyncio.to_thread(e.stop)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "per-sequence"])
async def test_kept_logits_come_back_with_a_state_from_the_state_cache(
    qwen: LlamaModel, per_sequence: bool
) -> None:
    """A prompt's sequence pushed out to the state cache takes its kept logits along: the
    same prompt asked after it comes back runs no prefill step either, and answers as
    its cold run did."""
    opts = EngineOptions(
        n_ctx=2048, n_seq_max=1, max_pins=0, speculation="off", kv_per_sequence=per_sequence
    )
    e = Engine(qwen, opts).start()
    try:
        first, other = (qwen.tokenize(ledger(k), add_special=False) for k in (6, 7))
        _, cold = await e.submit(EngineRequest(first, max_tokens=24)).collect()
        await e.submit(EngineRequest(other, max_tokens=4)).collect()  # takes the slot
        assert len(e.cache) == 1
        before = e.steps
        _, again = await e.submit(EngineRequest(first, max_tokens=24)).collect()
        assert (again.usage.prompt_reused, again.usage.prompt_computed) == (len(first), 0)
        assert again.tokens == cold.tokens
        assert e.steps - before == len(again.tokens) - 1  # no prefill step
    finally:
        await asyncio.to_thread(e.stop)


async def test_kept_logits_go_through_the_whole_sampler_chain(
    engine: Engine, qwen: LlamaModel
) -> None:
    """Sampling from kept logits applies the request's own chain (a seeded temperature,
    a grammar) and reports the logprobs the cold run's first token had."""
    prompt = qwen.tokenize(chatml(("user", "Is the sky blue? Answer yes or no.")))
    seeded = SamplingParams(temperature=0.9, seed=7, logprobs=3)
    cold_deltas, cold = await engine.submit(EngineRequest(prompt, seeded, 12)).collect()
    deltas, again = await engine.submit(EngineRequest(prompt, seeded, 12)).collect()
    assert again.usage.prompt_computed == 0
    assert again.tokens == cold.tokens
    assert deltas[0].logprobs == cold_deltas[0].logprobs
    assert len(deltas[0].logprobs[0].top) == 3
    gbnf = Format("grammar", text='root ::= "MAYBE" [.!]')
    maybe = SamplingParams(temperature=0, grammar=format_grammar(gbnf))
    deltas, done = await engine.submit(EngineRequest(prompt, maybe, 8)).collect()
    assert done.usage.prompt_computed == 0
    assert "".join(d.text for d in deltas) in ("MAYBE.", "MAYBE!")
