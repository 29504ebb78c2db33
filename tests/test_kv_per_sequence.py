"""A KV stream per sequence (`EngineOptions.kv_per_sequence`), on the tiny model: each
sequence gets n_ctx cells of its own, and what the engine does with one shared stream
still holds: concurrent answers, a conversation's next turn, a prefix another sequence
or a pin holds (its state copied, cut to the prefix), and a state restored from the
state cache. Answers are compared with a cold
engine of the same layout (flash attention on and off round differently)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.types import Done, EngineRequest, SessionId

N_CTX = 1024


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


def options(**kw: object) -> EngineOptions:
    return EngineOptions(n_ctx=N_CTX, kv_per_sequence=True, **kw)  # type: ignore[arg-type]


async def answer(engine: Engine, prompt: list[int], max_tokens: int, **kw: object) -> Done:
    request = EngineRequest(prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    _, done = await engine.submit(request).collect()
    return done


async def cold(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a fresh engine of this layout, with no state cache, answers with."""
    e = Engine(model, options(n_seq_max=1, max_pins=0, state_cache_bytes=0)).start()
    try:
        done = await answer(e, prompt, max_tokens)
        assert done.usage.prompt_reused == 0
        return list(done.tokens)
    finally:
        await asyncio.to_thread(e.stop)


async def test_each_sequence_gets_its_own_cells_and_concurrent_answers_hold(
    model: LlamaModel,
) -> None:
    opts = options(n_seq_max=4, max_pins=1)
    e = Engine(model, opts).start()
    try:
        assert ll.llama_n_ctx(e.ctx) == N_CTX * 5  # four sequences and a pin
        prompts = [model.tokenize(t) for t in ("Hello world", "def f(x):", "Dear Sir,", "1, 2,")]
        together = await asyncio.gather(*(answer(e, p, 30) for p in prompts))
        alone = [await cold(model, p, 30) for p in prompts]
        assert [list(d.tokens) for d in together] == alone
        assert len({tuple(t) for t in alone}) == len(prompts)
        # a request may use its sequence's whole context while another runs beside it
        long = model.tokenize("word " * (N_CTX - 20))
        assert len(long) > N_CTX - 40
        big, small = await asyncio.gather(answer(e, long, 8), answer(e, prompts[0], 30))
        assert len(big.tokens) == 8
        assert list(small.tokens) == alone[0]
    finally:
        await asyncio.to_thread(e.stop)


async def test_turns_prefixes_and_pins_are_reused_from_other_streams(model: LlamaModel) -> None:
    e = Engine(model, options(n_seq_max=3, max_pins=1)).start()
    try:
        system = model.tokenize("You are a careful assistant who answers briefly. " * 12)
        first = [*system, *model.tokenize(" What is 2+2?", add_special=False)]
        done1 = await answer(e, first, 12, session=SessionId("a"))
        # the next turn continues its own sequence
        turn2 = [*first, *done1.tokens, *model.tokenize(" And 3+3?", add_special=False)]
        done2 = await answer(e, turn2, 12, session=SessionId("a"))
        assert done2.usage.prompt_reused == len(first) + len(done1.tokens) - 1
        assert list(done2.tokens) == await cold(model, turn2, 12)
        # another user of the same system prompt copies it from a's stream
        other = [*system, *model.tokenize(" Name a colour.", add_special=False)]
        done3 = await answer(e, other, 12, session=SessionId("b"))
        assert done3.usage.prompt_reused >= len(system)
        assert list(done3.tokens) == await cold(model, other, 12)
        # and a's conversation is still whole in its own stream
        turn3 = [*turn2, *done2.tokens, *model.tokenize(" Thanks.", add_special=False)]
        done4 = await answer(e, turn3, 6, session=SessionId("a"))
        assert done4.usage.prompt_reused == len(turn2) + len(done2.tokens) - 1
        # a pinned prefix is copied the same way
        pinned = model.tokenize("Rules: be terse and exact. " * 10)
        assert await e.pin(pinned) == len(pinned)
        asked = [*pinned, *model.tokenize(" Why?", add_special=False)]
        done5 = await answer(e, asked, 10, session=SessionId("c"))
        assert done5.usage.prompt_reused == len(pinned)
        assert list(done5.tokens) == await cold(model, asked, 10)
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_conversation_comes_back_from_the_state_cache(model: LlamaModel) -> None:
    e = Engine(model, options(n_seq_max=1, max_pins=0)).start()
    try:
        a = model.tokenize("The quick brown fox")
        done_a = await answer(e, a, 30, session=SessionId("a"))
        # b takes the only sequence: a's state goes to the RAM cache
        await answer(e, model.tokenize("Lorem ipsum"), 30, session=SessionId("b"))
        assert len(e.cache) == 1
        turn2 = [*a, *done_a.tokens, *model.tokenize(" jumps", add_special=False)]
        done2 = await answer(e, turn2, 10, session=SessionId("a"))
        assert done2.usage.prompt_reused == len(a) + len(done_a.tokens) - 1
        assert list(done2.tokens) == await cold(model, turn2, 10)
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_conversation_moves_beside_the_running_sequences(model: LlamaModel) -> None:
    """llama.cpp decodes each run of consecutive sequence ids as a micro-batch of its
    own, reading all the weights again: a conversation parked two sequences away from a
    running one moves next to it, its cells copied along, and answers as a cold run does;
    the parked conversation it displaced comes back from the state cache."""
    e = Engine(model, options(n_seq_max=4, max_pins=0)).start()
    try:
        texts = {"a": "Once upon a time", "b": "def main():", "c": "The capital of France"}
        prompts = {name: model.tokenize(text) for name, text in texts.items()}
        first = {
            name: await answer(e, p, 8, session=SessionId(name)) for name, p in prompts.items()
        }
        assert [s.session for s in e.kv.slots] == ["a", "b", "c", None]
        history = {name: [*prompts[name], *first[name].tokens] for name in texts}
        # a's next turn runs on sequence 0 while c's comes, parked on sequence 2
        running = e.submit(
            EngineRequest(history["a"], max_tokens=400, ignore_eos=True, session=SessionId("a"))
        )
        await running.__anext__()
        turn_c = [*history["c"], *model.tokenize(" is", add_special=False)]
        done_c = await answer(e, turn_c, 10, session=SessionId("c"))
        assert [s.session for s in e.kv.slots[:3]] == ["a", "c", None]
        assert done_c.usage.prompt_reused == len(history["c"]) - 1
        assert list(done_c.tokens) == await cold(model, turn_c, 10)
        await running.collect()
        # b, moved out of sequence 1, comes back from the state cache
        turn_b = [*history["b"], *model.tokenize(" pass", add_special=False)]
        done_b = await answer(e, turn_b, 6, session=SessionId("b"))
        assert done_b.usage.prompt_reused == len(history["b"]) - 1
        assert list(done_b.tokens) == await cold(model, turn_b, 6)
    finally:
        await asyncio.to_thread(e.stop)


GAP_TEXTS = {"a": "Once upon a time", "b": "def main():", "c": "The capital of France"}
GAP_LENGTHS = {"a": 120, "b": 5, "c": 120}


async def short_between_long(
    e: Engine, model: LlamaModel
) -> tuple[dict[str, list[int]], list[Done]]:
    """Three greedy answers started together on sequences 0, 1 and 2 (sessions a, b, c):
    b's is short, so it ends between two running ones. Their prompts and results."""
    prompts = {name: model.tokenize(text) for name, text in GAP_TEXTS.items()}
    done = await asyncio.gather(
        *(
            answer(e, prompts[n], GAP_LENGTHS[n], ignore_eos=True, session=SessionId(n))
            for n in GAP_TEXTS
        )
    )
    return prompts, list(done)


async def test_a_gap_left_between_running_sequences_closes(model: LlamaModel) -> None:
    """A sequence that finishes between two running ones leaves their ids in two runs,
    so every later step would be two micro-batches: one running sequence moves into a
    free slot beside the other (an empty one before a parked conversation), its cells
    copied along, and both answers are what they are alone."""
    e = Engine(model, options(n_seq_max=4, max_pins=0)).start()
    try:
        prompts, done = await short_between_long(e, model)
        assert [len(d.tokens) for d in done] == [120, 5, 120]
        assert e.planner.gap_moves == 1
        # b finished on sequence 1 while a (0) and c (2) ran on: a moved to 3, beside c
        assert [s.session for s in e.kv.slots] == [None, "b", "c", "a"]
        assert e.kv.slots[0].tokens == []
        for name, d in zip(prompts, done, strict=True):
            alone = await cold(model, prompts[name], GAP_LENGTHS[name])
            if name != "b":
                assert list(d.tokens) == alone
        # a's conversation goes on from where it moved, its whole history reused
        history = [*prompts["a"], *done[0].tokens]
        turn = [*history, *model.tokenize(" The", add_special=False)]
        again = await answer(e, turn, 6, session=SessionId("a"))
        assert again.usage.prompt_reused >= len(history) - 1
        assert list(again.tokens) == await cold(model, turn, 6)
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_gap_closes_over_a_parked_conversation_which_the_state_cache_keeps(
    model: LlamaModel,
) -> None:
    """With no empty slot, the running sequence moves into the finished one's slot: that
    conversation goes to the state cache first and its next turn reuses it from there."""
    e = Engine(model, options(n_seq_max=3, max_pins=0)).start()
    try:
        prompts, done = await short_between_long(e, model)
        assert e.planner.gap_moves == 1
        sessions = [s.session for s in e.kv.slots]
        assert "b" not in sessions
        assert sorted(s for s in sessions if s) == ["a", "c"]
        for name in ("a", "c"):
            assert list(done["abc".index(name)].tokens) == await cold(
                model, prompts[name], GAP_LENGTHS[name]
            )
        history = [*prompts["b"], *done[1].tokens]
        turn = [*history, *model.tokenize(" pass", add_special=False)]
        again = await answer(e, turn, 6, session=SessionId("b"))
        assert again.usage.prompt_reused == len(history) - 1
        assert list(again.tokens) == await cold(model, turn, 6)
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_prompt_read_between_generating_sequences_lists_its_rows_in_their_order(
    model: LlamaModel, decoded: list[list[tuple[int, int, int]]]
) -> None:
    """llama.cpp splits a step with a KV stream per sequence into micro-batches of
    consecutive sequence ids, taking each id in the order the batch lists it: a prompt
    on sequence 1 listed after generating sequences 0 and 2 split the step's first rows
    in two micro-batches (a pass over the weights more). Every step lists its
    sequences' rows in sequence order, each sequence's together."""
    e = Engine(model, options(n_seq_max=3, max_pins=0, prefill_chunk=64)).start()
    try:
        texts = ["Once upon a time", "def main():", "The capital of France"]
        prompts = [model.tokenize(t) for t in texts]
        document = " ".join(f"entry {k} reads {k * 7 % 97}" for k in range(60))
        prompts.append(model.tokenize(document))  # waits for b's slot (1), between a and c
        lengths = [60, 4, 60, 4]
        done = await asyncio.gather(
            *(answer(e, p, n, ignore_eos=True) for p, n in zip(prompts, lengths, strict=True))
        )
        assert [len(d.tokens) for d in done] == lengths
        steps = [[q for q, _, _ in rows] for rows in decoded]
        beside = [s for s in steps if {0, 2} <= set(s) and s.count(1) > 1]
        assert beside, "the document was never read beside both generating sequences"
        for step in steps:
            assert step == sorted(step)
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_prompt_waiting_between_generating_sequences_lends_them_a_row(
    model: LlamaModel, decoded: list[list[tuple[int, int, int]]]
) -> None:
    """Two prompts take the slots of two short answers between running ones; while the
    first is read, the second waits, its id a gap among the step's that would split the
    running rows in two micro-batches: it lends the step one prompt row (in their
    micro-batch), and its answer is what it is alone."""
    e = Engine(model, options(n_seq_max=5, max_pins=0, prefill_chunk=64)).start()
    try:
        texts = ["Once upon a time", "def main():", "The capital of France", "1, 2,", "Hi"]
        prompts = [model.tokenize(t) for t in texts]
        for k in range(2):  # they wait for the short answers' slots
            words = " ".join(f"entry {k}-{j} reads {j * 7 % 97}" for j in range(60))
            prompts.append(model.tokenize(words))
        lengths = [80, 4, 80, 4, 80, 4, 4]
        done = await asyncio.gather(
            *(answer(e, p, n, ignore_eos=True) for p, n in zip(prompts, lengths, strict=True))
        )
        assert [len(d.tokens) for d in done] == lengths
        waiting = prompts[6]
        lent = 0
        for step in decoded:
            assert [q for q, _, _ in step] == sorted(q for q, _, _ in step)
            by_seq: dict[int, list[tuple[int, int]]] = {}
            for q, token, pos in step:
                by_seq.setdefault(q, []).append((token, pos))
            for q, rows in by_seq.items():
                (token, pos), others = rows[0], set(by_seq) - {q}
                read = any(len(by_seq[o]) >= 64 for o in others)
                if len(rows) == 1 and pos < len(waiting) - 1 and waiting[pos] == token and read:
                    assert min(others) < q < max(others)
                    lent += 1
        assert lent, "the waiting prompt never lent a row to a step that read the other"
        assert list(done[6].tokens) == await cold(model, waiting, 4)
    finally:
        await asyncio.to_thread(e.stop)
