"""Prompt-lookup speculative decoding in the engine: the same greedy output with and
without it (tiny and Qwen), drafts that are verified and counted, and the KV left
holding exactly the sequence's tokens.

Seeded sampling keeps its distribution and its random stream (one draw per kept token),
but not bit for bit: logits computed in a wider step differ in the last bits, which can
move a draw across a boundary; greedy output is what the tests pin."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.observer import NoObserver
from barrel.engine.speculate import ALIGN, NgramDrafter, align_drafts
from barrel.engine.types import EngineRequest, FinishReason, SamplingParams, SessionId
from barrel.metrics import Metrics
from bench.drafts import replay

GREEDY = SamplingParams(temperature=0)
CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''


def test_the_drafter_proposes_what_followed_the_trailing_ngram() -> None:
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2], n=2, k=3)
    assert d.draft(room=10) == [3, 4, 5]  # "1 2" was followed by 3 4 5
    assert d.draft(room=2) == [3, 4]
    d.extend([7])
    assert d.draft(room=10) == []  # "2 7" never seen before
    d.extend([1, 2])
    assert d.draft(room=10) == [7, 1, 2]  # the latest occurrence wins
    d.record(drafted=3, accepted=3)  # a whole draft kept: the next may be longer
    d.record(drafted=3, accepted=0)
    assert d.active
    for _ in range(6):  # eight attempts that kept almost nothing
        d.record(drafted=3, accepted=0)
    assert not d.active  # drafting did not pay: it stops
    assert d.draft(room=10) == []


def test_the_drafter_follows_a_copy_in_order() -> None:
    # Two similar "functions", 1 2 3 4 and 1 2 3 5, copied from the prompt: once the copy
    # has passed the first, the 3-gram "1 2 3" was last followed by 4 (in the copy
    # itself), but the source goes on with 5.
    source = [7, 8, 1, 2, 3, 4, 9, 1, 2, 3, 5, 6]
    d = NgramDrafter([*source, 7, 8, 1], n=3, k=6)
    assert d.draft(room=10) == [2, 3, 4, 9, 1, 2]
    d.record(drafted=6, accepted=6)
    d.extend([2, 3, 4, 9, 1, 2, 3])  # the draft and the token sampled after it
    assert d.draft(room=10) == [5, 6, 7, 8, 1, 2]
    # the token sampled after a kept draft is not the source's next (5, not 3): the
    # copy has left the source, and "1 2 5" was never seen
    d = NgramDrafter([*source, 7, 8, 1], n=3, k=6)
    assert d.draft(room=10) == [2, 3, 4, 9, 1, 2]
    d.record(drafted=6, accepted=6)
    d.extend([2, 3, 4, 9, 1, 2, 5])
    assert d.draft(room=10) == []


@pytest.mark.parametrize(
    ("drafts", "n", "left"),
    [
        ([[1, 2, 3]], 4, [[1, 2, 3]]),  # pending + 3: a multiple of four already
        ([[1] * 16], 17, [[1] * 15]),  # pending + 16: the sixteenth goes
        ([[1, 2], [3, 4, 5, 6]], 8, [[1, 2], [3, 4, 5, 6]]),
        ([[1, 2], [3, 4, 5, 6, 7]], 9, [[1, 2], [3, 4, 5, 6]]),  # the longest loses its last
        ([[1, 2, 3], [4, 5, 6]], 9, [[1, 2], [4, 5, 6]]),
        ([[1, 2]], 3, [[]]),  # pending + 2: a step of three, too few drafts to reach four
        ([[1], []], 3, [[], []]),  # two sequences, one draft token: the draft goes
        ([[1, 2], [3]], 8 + 3, [[], []]),  # eight sequences, three draft tokens
        ([[], []], 7, [[], []]),  # no drafts: nothing to trim (prompt chunks are never cut)
    ],
)
def test_a_step_with_drafts_is_trimmed_to_a_multiple_of_four(
    drafts: list[list[int]], n: int, left: list[list[int]]
) -> None:
    align_drafts(drafts, n)
    assert drafts == left


class _Steps(NoObserver):
    """The engine's steps, in order: (tokens, draft tokens verified in the step)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self._drafted = 0

    def drafted(self, drafted: int, accepted: int) -> None:
        self._drafted += drafted

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        self.steps.append((tokens, self._drafted))
        self._drafted = 0


async def test_every_step_that_verifies_drafts_is_a_multiple_of_four(tiny: LlamaModel) -> None:
    walk = tiny.tokenize(" red green blue", add_special=False)
    sampling = SamplingParams(temperature=0, logit_bias={t: 30.0 for t in walk})
    observer = _Steps()
    opts = EngineOptions(n_ctx=2048, n_seq_max=4, speculation="ngram")
    e = Engine(tiny, opts, observer=observer).start()
    try:
        for prompts in (_prompts(tiny, chat=False)[:1], _prompts(tiny, chat=False)):
            runs = [
                e.submit(EngineRequest(p, max_tokens=96, sampling=sampling)).collect()
                for p in prompts
            ]
            await asyncio.gather(*runs)
    finally:
        await asyncio.to_thread(e.stop)
    with_drafts = [tokens for tokens, drafted in observer.steps if drafted]
    assert with_drafts  # drafts were verified, alone and beside other sequences
    assert all(tokens % ALIGN == 0 for tokens in with_drafts), with_drafts


async def test_a_step_that_reads_prompt_rows_verifies_no_guesses(qwen: LlamaModel) -> None:
    """A generating sequence drafts in steps of its own and not in the steps that read a
    prompt beside it: a guess's few rows over a whole context take the dear row-by-row
    attention kernel, and the prompt's first token would wait for them. Here a copy
    (drafts kept) runs while a 700-token prompt is read in chunks of 64."""
    words = " ".join(f"entry {k} of the ledger" for k in range(200))
    prompt = qwen.tokenize(words)[:700]
    observer = _Steps()
    opts = EngineOptions(n_ctx=2048, n_seq_max=4, speculation="ngram", prefill_chunk=64)
    e = Engine(qwen, opts, observer=observer).start()
    try:
        count = qwen.tokenize(" ".join(["one two three four five six seven eight"] * 4))
        walker = e.submit(EngineRequest(count, max_tokens=160, sampling=GREEDY))
        async for _ in walker:  # until the copy drafts
            if any(drafted for _, drafted in observer.steps):
                break
        reader = e.submit(EngineRequest(prompt, max_tokens=1))  # read beside the copy
        (_, copied), (_, read) = await asyncio.gather(walker.collect(), reader.collect())
        assert read.usage.prompt_computed == len(prompt)
    finally:
        await asyncio.to_thread(e.stop)
    # after the copy's first draft, a step's rows beyond its drafts and the pending
    # tokens of the (at most two) generating sequences are the prompt's
    drafting = [i for i, (_, drafted) in enumerate(observer.steps) if drafted]
    reading = [
        i
        for i, (tokens, drafted) in enumerate(observer.steps)
        if i > drafting[0] and tokens - drafted > 2
    ]
    assert len(reading) >= len(prompt) // 64  # the prompt was read in chunks ...
    assert reading[-1] < drafting[-1]  # ... while the copy drafted, before and after
    assert copied.finish_reason == FinishReason.LENGTH  # (it counted all along)
    assert not set(reading) & set(drafting), observer.steps


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


@pytest.fixture(scope="module")
def qwen(qwen_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(qwen_path)
    yield m
    m.free()


async def _outputs(
    model: LlamaModel,
    speculation: str,
    prompts: list[list[int]],
    sampling: SamplingParams,
    per_sequence: bool = False,
    max_tokens: int = 96,
) -> tuple[list[tuple[int, ...]], Metrics]:
    metrics = Metrics()
    opts = EngineOptions(
        n_ctx=2048, n_seq_max=4, speculation=speculation, kv_per_sequence=per_sequence
    )
    e = Engine(model, opts, observer=metrics.engine_observer("m")).start()
    try:
        runs = [
            e.submit(EngineRequest(p, max_tokens=max_tokens, sampling=sampling)).collect()
            for p in prompts
        ]
        done = [d for _, d in await asyncio.gather(*runs)]  # concurrent: drafts in one batch
        return [d.tokens for d in done], metrics
    finally:
        await asyncio.to_thread(e.stop)


def _counted(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m"})
    return value or 0.0


def _prompts(model: LlamaModel, chat: bool) -> list[list[int]]:
    texts = [
        f"Copy this file exactly:\n\n{CODE}\nThe copy:\n\n",
        f"{CODE}\n# The same two functions again:\n",
        "Count: one two three four five six seven eight nine ten, one two three",
    ]
    if chat:
        texts = [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts]
    return [model.tokenize(t) for t in texts]


async def test_qwen_gives_the_same_tokens_with_drafts_and_keeps_most_of_them(
    qwen: LlamaModel,
) -> None:
    prompts = _prompts(qwen, chat=True)
    plain, off = await _outputs(qwen, "off", prompts, GREEDY, max_tokens=48)
    drafted, on = await _outputs(qwen, "ngram", prompts, GREEDY, max_tokens=48)
    assert drafted == plain
    assert _counted(off, "barrel_engine_draft_tokens_total") == 0
    tried = _counted(on, "barrel_engine_draft_tokens_total")
    kept = _counted(on, "barrel_engine_draft_accepted_tokens_total")
    assert tried > 0
    assert kept > 0  # some drafts were the right tokens (and the output is unchanged)


async def test_with_a_stream_per_sequence_a_copy_drafts_beside_a_sequence_that_does_not(
    qwen: LlamaModel,
) -> None:
    """A step over several KV streams is one micro-batch only if every sequence brings as
    many tokens: a draft beside a sequence without one costs a second micro-batch, which
    a copy pays for. Here the other sequence (numbers in words, nothing to draft from)
    runs longer than the copy: the copy drafts beside it, and answers as it does alone."""
    copy = _prompts(qwen, chat=True)[0]
    words = qwen.tokenize(
        "<|im_start|>user\nWrite the numbers 1 to 200 in words.<|im_end|>\n<|im_start|>assistant\n"
    )
    (alone,), _ = await _outputs(qwen, "ngram", [copy], GREEDY, per_sequence=True)
    (together, other), on = await _outputs(qwen, "ngram", [copy, words], GREEDY, per_sequence=True)
    assert together == alone
    assert len(other) > len(together)  # the copy never ran alone
    tried = _counted(on, "barrel_engine_draft_tokens_total")
    kept = _counted(on, "barrel_engine_draft_accepted_tokens_total")
    assert tried > 0
    assert kept > 0


async def test_tiny_gives_the_same_tokens_with_drafts(tiny: LlamaModel) -> None:
    # The random model never repeats itself unless told: a bias to three tokens makes
    # its output a walk over them, so its trigrams recur, drafts come and some are wrong.
    walk = tiny.tokenize(" red green blue", add_special=False)
    sampling = SamplingParams(temperature=0, logit_bias={t: 30.0 for t in walk})
    prompts = _prompts(tiny, chat=False)
    plain, _ = await _outputs(tiny, "off", prompts, sampling)
    drafted, on = await _outputs(tiny, "ngram", prompts, sampling)
    assert drafted == plain
    tried = _counted(on, "barrel_engine_draft_tokens_total")
    kept = _counted(on, "barrel_engine_draft_accepted_tokens_total")
    assert tried > 0
    assert kept > 0


async def test_rejected_drafts_leave_no_cells_behind(qwen: LlamaModel) -> None:
    """After a generation with drafts, the sequence's KV holds exactly its tokens (the
    prompt and every generated token but the last, never decoded), and the next turn
    reuses all of them."""
    (prompt, *_) = _prompts(qwen, chat=True)
    metrics = Metrics()
    opts = EngineOptions(n_ctx=2048, n_seq_max=2, state_cache_bytes=0, speculation="ngram")
    e = Engine(qwen, opts, observer=metrics.engine_observer("m")).start()
    try:
        session = SessionId("s")
        first = EngineRequest(prompt, max_tokens=60, sampling=GREEDY, session=session)
        _, done = await e.submit(first).collect()
        tried = _counted(metrics, "barrel_engine_draft_tokens_total")
        assert tried > _counted(metrics, "barrel_engine_draft_accepted_tokens_total") > 0
        (slot,) = [s for s in e.kv.slots if s.session == session]
        assert slot.tokens == [*prompt, *done.tokens[:-1]]
        # the engine is idle: its thread waits on the inbox
        assert ll.llama_memory_seq_pos_max(e.kv.mem, slot.seq) == len(slot.tokens) - 1
        follow = [*prompt, *done.tokens, *qwen.tokenize("\nAgain:", add_special=False)]
        second = EngineRequest(follow, max_tokens=8, sampling=GREEDY, session=session)
        _, again = await e.submit(second).collect()
        assert again.usage.prompt_reused == len(prompt) + len(done.tokens) - 1
    finally:
        await asyncio.to_thread(e.stop)


class _Drafts(NoObserver):
    """Every verified draft, in order: (draft tokens, kept)."""

    def __init__(self) -> None:
        self.drafts: list[tuple[int, int]] = []

    def drafted(self, drafted: int, accepted: int) -> None:
        self.drafts.append((drafted, accepted))


@pytest.mark.parametrize("which", ["tiny", pytest.param("qwen", marks=pytest.mark.real_model)])
async def test_bench_drafts_replays_the_engine_s_drafts_exactly(
    which: str, request: pytest.FixtureRequest
) -> None:
    """bench/drafts.py estimates drafting policies by replaying a recorded greedy answer;
    its replay must draft, trim and keep as the engine did for that answer."""
    model: LlamaModel = request.getfixturevalue(which)
    opts = EngineOptions(n_ctx=2048, n_seq_max=1, speculation="ngram", state_cache_bytes=0)
    sampling = GREEDY
    if which == "tiny":  # a biased walk over three tokens: short n-grams, drafts kept or not
        walk = model.tokenize(" red green blue", add_special=False)
        sampling = SamplingParams(temperature=0, logit_bias={t: 30.0 for t in walk})
        opts = dataclasses.replace(opts, draft_ngram=3)
    prompt = _prompts(model, chat=which == "qwen")[0]
    observer = _Drafts()
    e = Engine(model, opts, observer=observer).start()
    try:
        request_ = EngineRequest(prompt, max_tokens=120, sampling=sampling)
        _, done = await e.submit(request_).collect()
    finally:
        await asyncio.to_thread(e.stop)
    drafter = NgramDrafter(list(prompt), opts.draft_ngram, opts.draft_max)
    steps = replay(prompt, list(done.tokens), drafter, 120, n_ctx=2048)
    assert [s for s in steps if s[0]] == observer.drafts
    assert any(kept for _, kept in observer.drafts)  # drafts were kept ...
    assert len(steps) < len(done.tokens) - 1  # ... so fewer steps than tokens
    if which == "tiny":
        assert any(kept < drafted for drafted, kept in observer.drafts)  # and some missed
