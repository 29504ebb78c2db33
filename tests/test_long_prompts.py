"""A long prompt reads the same whatever else the engine does meanwhile: alone, beside
running streams (its prompt cut into chunks sized by `prefill_step_s`) and after a
neighbour cancelled in the middle of its own prefill, its greedy answer is the answer
of the same prompt run alone (batch-invariant kernels, tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.plan import TAIL_ROWS
from barrel.engine.run import Run
from barrel.engine.types import EngineRequest, FinishReason, RequestId

N_CTX = 4096


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


def long_prompt(model: LlamaModel, seed: int) -> list[int]:
    words = " ".join(f"note {seed}-{k} reads {k * 7 % 97}" for k in range(400))
    return model.tokenize(words)[:1800]


async def alone(model: LlamaModel, prompt: list[int]) -> tuple[int, ...]:
    e = Engine(model, EngineOptions(n_ctx=N_CTX, n_seq_max=1, state_cache_bytes=0)).start()
    try:
        _, done = await e.submit(EngineRequest(prompt, max_tokens=24)).collect()
        assert done.usage.prompt_computed == len(prompt)
        return done.tokens
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_long_prompt_answers_alike_alone_beside_streams_and_after_a_cancel(
    model: LlamaModel,
) -> None:
    prompt = long_prompt(model, 1)
    expected = await alone(model, prompt)
    e = Engine(model, EngineOptions(n_ctx=N_CTX, n_seq_max=4, prefill_chunk=64)).start()
    try:
        # beside three running streams
        streams = [
            e.submit(EngineRequest(model.tokenize(f"Story {i}:"), max_tokens=4000))
            for i in range(3)
        ]
        for s in streams:
            await anext(s)
        late = e.submit(EngineRequest(prompt, max_tokens=24))
        first = asyncio.ensure_future(anext(late))
        beside = 0
        while not first.done():
            await anext(streams[0])
            beside += 1
        assert beside >= 2, "the streams kept generating while the prompt was read"
        _, done = await late.collect()
        assert done.tokens == expected
        assert done.usage.prompt_computed == len(prompt)
        for s in streams:
            s.cancel()
            await s.collect()
        # after a neighbour cancelled in the middle of its own prefill (64 prompt rows a
        # step beside the running stream, the neighbour's first: each token of the
        # stream is one step)
        running = e.submit(EngineRequest(model.tokenize("Story:"), max_tokens=4000))
        await anext(running)
        other = e.submit(EngineRequest(long_prompt(model, 2), max_tokens=24))
        again = e.submit(EngineRequest(prompt, max_tokens=24))
        for _ in range(3):
            await anext(running)
        other.cancel()
        _, cancelled = await other.collect()
        assert cancelled.finish_reason is FinishReason.CANCELLED
        assert cancelled.usage.completion_tokens == 0, "cancelled while it was read"
        _, done = await again.collect()
        assert done.tokens == expected
        running.cancel()
        await running.collect()
    finally:
        await asyncio.to_thread(e.stop)


async def test_the_step_budget_grows_with_quick_steps_and_keeps_its_floor(
    model: LlamaModel,
) -> None:
    """With `prefill_step_s` a step beside generating sequences takes more than
    `prefill_chunk` prompt rows once rows are timed as cheap; without it, exactly that."""
    for step_s, grows in ((0.0, False), (30.0, True)):
        opts = EngineOptions(n_ctx=N_CTX, n_seq_max=2, prefill_chunk=64, prefill_step_s=step_s)
        e = Engine(model, opts).start()
        try:
            running = e.submit(EngineRequest(model.tokenize("Story:"), max_tokens=4000))
            await anext(running)
            _, warm = await e.submit(EngineRequest(long_prompt(model, 3), max_tokens=1)).collect()
            assert warm.usage.prompt_computed > 64
            assert (e.planner.budget() > 64) is grows
            running.cancel()
            await running.collect()
        finally:
            await asyncio.to_thread(e.stop)


async def test_a_short_prompt_beside_a_long_one_reads_first(model: LlamaModel) -> None:
    """Two prompts being read beside a running stream: the one with fewer rows left
    gets the step's rows first, so its first token comes while the long prompt, which
    came first, is still being read; the long one keeps a share meanwhile and answers
    as it does alone."""
    prompt = long_prompt(model, 4)
    expected = await alone(model, prompt)
    opts = EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64, prefill_order="shortest")
    e = Engine(model, opts).start()
    try:
        running = e.submit(EngineRequest(model.tokenize("Story:"), max_tokens=4000))
        await anext(running)
        long = e.submit(EngineRequest(prompt, max_tokens=24))
        short = e.submit(EngineRequest(model.tokenize("What is two and two?"), max_tokens=2))
        long_first = asyncio.ensure_future(anext(long))
        short_first = asyncio.ensure_future(anext(short))
        done, _ = await asyncio.wait({long_first, short_first}, return_when="FIRST_COMPLETED")
        assert short_first in done
        assert not long_first.done(), "the long prompt was still being read"
        await short.collect()
        await long_first
        _, answer = await long.collect()
        assert answer.tokens == expected
        running.cancel()
        await running.collect()
    finally:
        await asyncio.to_thread(e.stop)


def _run(rid: int, tokens: int) -> Run:
    request = EngineRequest(list(range(1, tokens + 1)))
    return Run(RequestId(rid), request, None, None)  # type: ignore[arg-type]


def test_the_step_s_rows_go_to_the_shortest_prompt_and_a_quarter_to_the_oldest(
    model: LlamaModel,
) -> None:
    opts = EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64, prefill_order="shortest")
    e = Engine(model, opts)
    try:
        old, short, middle = _run(1, 1000), _run(2, 100), _run(3, 300)
        shares = e.planner.shares([old, short, middle], 256)
        assert [(r.id, n) for r, n in shares] == [(2, 100), (3, 92), (1, 64)]
        # the oldest is also the shortest: nothing held for it
        shares = e.planner.shares([short, old, middle], 256)
        assert [(r.id, n) for r, n in shares] == [(2, 100), (3, 156)]
        assert [(r.id, n) for r, n in e.planner.shares([old], 256)] == [(1, 256)]
    finally:
        e.stop()


def test_in_arrival_order_the_first_prompt_is_read_whole_before_the_next(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64))  # the default
    try:
        old, short, middle = _run(1, 1000), _run(2, 100), _run(3, 300)
        assert [(r.id, n) for r, n in e.planner.shares([old, short, middle], 256)] == [(1, 256)]
        # the short prompt's last rows end the step: its first token does not wait for
        # 156 rows of the next prompt, which starts a step later
        assert [(r.id, n) for r, n in e.planner.shares([short, middle, old], 256)] == [(2, 100)]
        # ... where a later prompt joins only whole, within FINISH_ROWS in all
        tiny, tiny2 = _run(4, 20), _run(5, 20)
        shares = e.planner.shares([short, tiny, tiny2, old], 256)
        assert [(r.id, n) for r, n in shares] == [(2, 100), (4, 20)]
        # prompts that come together share their first step
        burst = [_run(10 + i, 20) for i in range(8)]
        assert [n for _, n in e.planner.shares(burst, 256)] == [20] * 6
        # a chunk that stops short of its prompt's end (a tail kept for later) ends the
        # step's prompt rows: the next prompt's 20 rows would split it under a tile
        first = _run(6, 300)
        assert [(r.id, n) for r, n in e.planner.shares([first, middle], 256)] == [(6, 235)]
        # the tail of a prompt read in earlier steps ends its step too
        middle.n_past = 250
        assert [(r.id, n) for r, n in e.planner.shares([middle, old], 256)] == [(3, 50)]
    finally:
        e.stop()


def test_no_chunk_leaves_a_tail_of_fewer_rows_than_an_attention_tile(model: LlamaModel) -> None:
    """A prompt's last few rows read in a step of their own go through ggml's row-by-row
    attention kernel (fewer than 64 query rows; beside generating sequences with a KV
    stream each, its first row goes to their micro-batch), dear over a long context: a
    chunk takes them too where the batch has room, else stops TAIL_ROWS (65) short."""
    for order in ("arrival", "shortest"):
        opts = EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64, prefill_order=order)
        e = Engine(model, opts)
        try:
            p = _run(1, 300)
            assert [n for _, n in e.planner.shares([p], 256, room=512)] == [300]
            assert [n for _, n in e.planner.shares([p], 256, room=256)] == [300 - TAIL_ROWS]
            assert [n for _, n in e.planner.shares([p], 256)] == [300 - TAIL_ROWS]
            # 64 rows left would be 1 + 63 beside generating sequences
            assert [n for _, n in e.planner.shares([p], 236, room=236)] == [235]
            p.n_past = 300 - 256 - TAIL_ROWS + 20  # a tail of a whole tile stays for later
            assert [n for _, n in e.planner.shares([p], 236, room=512)] == [236]
            # a batch smaller than a tile: its rows, as many as it has
            assert [n for _, n in e.planner.shares([_run(2, 50)], 10, room=10)] == [10]
        finally:
            e.stop()
    # shortest first: the oldest prompt's chunk gets what the shorter one leaves of the room
    opts = EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64, prefill_order="shortest")
    e = Engine(model, opts)
    try:
        old, short = _run(1, 400), _run(2, 100)
        old.n_past = 204  # 196 rows left: 156 of the budget would leave 40
        assert [(r.id, n) for r, n in e.planner.shares([old, short], 256, room=420)] == [
            (2, 100),
            (1, 196),
        ]
        assert [(r.id, n) for r, n in e.planner.shares([old, short], 256, room=250)] == [
            (2, 100),
            (1, 196 - TAIL_ROWS),
        ]
    finally:
        e.stop()


def test_the_budget_grows_while_prompts_outnumber_the_streams(model: LlamaModel) -> None:
    opts = EngineOptions(n_ctx=N_CTX, n_seq_max=3, prefill_chunk=64, prefill_step_s=1.0)
    e = Engine(model, opts)
    try:
        e.planner.row_s = 0.01  # as if rows had cost 10 ms lately
        assert e.planner.budget(generating=1, waiting=1) == 100
        assert e.planner.budget(generating=1, waiting=3) == 300
        assert e.planner.budget(generating=2, waiting=3) == 150
        assert e.planner.budget(generating=4, waiting=1) == 100  # never below the step
        e.planner.row_s = 0.1
        assert e.planner.budget(generating=4, waiting=1) == 64  # nor the floor
    finally:
        e.stop()
