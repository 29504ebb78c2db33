"""The continuous-batching engine over real llama.cpp, on the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.errors import EngineCrashed, PromptTooLong
from barrel.engine.kvcache import common_prefix
from barrel.engine.model import LlamaModel
from barrel.engine.slots import PARKED_MAX_CELLS
from barrel.engine.types import (
    Delta,
    Done,
    EngineRequest,
    FinishReason,
    SamplingParams,
    SessionId,
)
from barrel.pipeline.formats import json_schema_grammar

PROMPTS = ["Hello world", "Once upon a time", "def f(x):", "The capital of France is"]


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


@pytest.fixture
async def engine(model: LlamaModel) -> AsyncIterator[Engine]:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=4)).start()
    yield e
    await asyncio.to_thread(e.stop)


async def generate(engine: Engine, req: EngineRequest) -> tuple[str, Done, list[Delta]]:
    deltas, done = await engine.submit(req).collect()
    return "".join(d.text for d in deltas), done, deltas


def req(model: LlamaModel, text: str, **kw: object) -> EngineRequest:
    return EngineRequest(model.tokenize(text), **kw)  # type: ignore[arg-type]


async def cold_answer(
    model: LlamaModel, prompt: list[int], n_ctx: int, max_tokens: int
) -> list[int]:
    """The tokens a fresh engine with no state cache answers `prompt` with."""
    e = Engine(model, EngineOptions(n_ctx=n_ctx, n_seq_max=1, state_cache_bytes=0)).start()
    try:
        _, done, _ = await generate(e, EngineRequest(prompt, max_tokens=max_tokens))
    finally:
        e.stop()
    return done.tokens


async def test_concurrent_sequences_match_each_alone_at_temperature_0(
    engine: Engine, model: LlamaModel
) -> None:
    prompts = [*PROMPTS, "import numpy as np", "SELECT * FROM", "Dear Sir,", "1, 2, 3,"]
    alone = [(await generate(engine, req(model, p, max_tokens=40)))[1].tokens for p in prompts]
    # 8 requests on 4 sequences: four run, four wait, all in one batch at a time
    together = await asyncio.gather(
        *(generate(engine, req(model, p, max_tokens=40)) for p in prompts)
    )
    assert [done.tokens for _, done, _ in together] == alone
    assert len({t for t in alone}) == len(prompts), "distinct prompts give distinct outputs"


async def test_text_is_whole_utf8_and_matches_the_tokens(engine: Engine, model: LlamaModel) -> None:
    text, done, deltas = await generate(engine, req(model, "Hello world", max_tokens=120))
    assert text == model.detokenize(list(done.tokens))
    assert any(ord(c) > 0x7F for c in text), "the tiny model emits multi-byte characters"
    # every token arrives exactly once, in order
    assert [t for d in deltas for t in d.tokens] == list(done.tokens)
    assert done.finish_reason is FinishReason.LENGTH
    assert done.usage.completion_tokens == 120


async def test_stop_string_across_tokens_stops_and_is_never_emitted(
    engine: Engine, model: LlamaModel
) -> None:
    _, free_run, _ = await generate(engine, req(model, "Once upon a time", max_tokens=60))
    pieces = [model.detokenize([t]) for t in free_run.tokens]
    # a stop string made of the end of token 10 and the start of token 11
    i = next(i for i in range(10, 50) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    full = model.detokenize(list(free_run.tokens))
    text, done, _ = await generate(
        engine, req(model, "Once upon a time", max_tokens=60, stop=(stop,))
    )
    assert stop not in text
    assert text == full[: full.index(stop)]
    assert done.finish_reason is FinishReason.STOP
    assert done.stop_sequence == stop


async def test_max_tokens_and_full_context_end_with_length(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=64, n_seq_max=1)).start()
    try:
        prompt = model.tokenize("Hello world")
        _text, done, _ = await generate(e, EngineRequest(prompt))
        assert done.finish_reason is FinishReason.LENGTH
        assert len(prompt) + done.usage.completion_tokens == 64
        with pytest.raises(PromptTooLong):
            e.submit(EngineRequest(list(range(100, 164))))
    finally:
        e.stop()


@pytest.mark.parametrize(("gather_s", "steps"), [(30.0, 1), (0.0, 2)])
async def test_requests_arriving_together_share_the_first_step(
    model: LlamaModel, gather_s: float, steps: int
) -> None:
    """An idle engine waits up to `gather_s` for the requests of open sessions to join a
    request's first step, and no longer once they are in; a request that misses it waits
    a whole step for its first token."""
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=2, gather_s=gather_s)).start()
    try:
        e.expect(2)  # two sessions open: two clients on their way
        first = e.submit(req(model, "Hello world", max_tokens=1))
        await asyncio.sleep(0.05)  # a concurrent client, a little later
        second = e.submit(req(model, "Once upon a time", max_tokens=1))
        # far below gather_s: the step starts when the second request is in
        await asyncio.wait_for(first.collect(), timeout=20)
        await asyncio.wait_for(second.collect(), timeout=20)
        assert e.steps == steps
    finally:
        e.stop()


async def test_a_lone_request_does_not_wait_to_be_joined(model: LlamaModel) -> None:
    """With no other session open, nobody can join the first step: it starts at once,
    not `gather_s` later; a session that closed without a request stops the wait too."""
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=2, gather_s=30.0)).start()
    try:
        e.expect(2)
        e.expect(-1)  # one client went away before its request
        lone = e.submit(req(model, "Hello world", max_tokens=1))
        _, done = await asyncio.wait_for(lone.collect(), timeout=20)
        assert done.usage.completion_tokens == 1
        assert e.steps == 1
    finally:
        e.stop()


async def test_cancelled_sequence_frees_its_slot_within_one_step(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=1)).start()
    try:
        first = e.submit(req(model, "Hello world", max_tokens=1000))
        # one token: no step of its own after the one the count below looks at
        second = e.submit(req(model, "Once upon a time", max_tokens=1))
        await anext(first)
        cancelled_at = e.steps
        first.cancel()
        _, done = await first.collect()
        assert done.finish_reason is FinishReason.CANCELLED
        assert done.usage.completion_tokens < 1000
        await anext(second)
        # the step in flight when the cancel came, then the waiting request's prefill
        assert e.steps <= cancelled_at + 2
        _, done2 = await second.collect()
        assert done2.finish_reason is FinishReason.LENGTH
    finally:
        e.stop()


async def test_cancelling_a_queued_request(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=1)).start()
    try:
        running = e.submit(req(model, "Hello", max_tokens=200))
        queued = e.submit(req(model, "World", max_tokens=200))
        queued.cancel()
        _, done = await queued.collect()
        assert done.finish_reason is FinishReason.CANCELLED
        assert done.usage.completion_tokens == 0
        _, done = await running.collect()
        assert done.usage.completion_tokens == 200
    finally:
        e.stop()


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


async def test_grammar_output_validates_against_the_schema_for_20_seeds(
    engine: Engine, model: LlamaModel
) -> None:
    grammar = json_schema_grammar(SCHEMA)

    async def one(seed: int) -> str:
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
        text, done, _ = await generate(
            engine, req(model, "JSON:", sampling=sampling, max_tokens=400)
        )
        assert done.finish_reason is FinishReason.STOP, (seed, text)
        return text

    texts = await asyncio.gather(*(one(seed) for seed in range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1, "different seeds sample different documents"


async def test_seed_makes_sampling_reproducible(engine: Engine, model: LlamaModel) -> None:
    def sampling(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=seed)

    a = (await generate(engine, req(model, "Hi", sampling=sampling(7), max_tokens=30)))[1].tokens
    b = (await generate(engine, req(model, "Hi", sampling=sampling(7), max_tokens=30)))[1].tokens
    c = (await generate(engine, req(model, "Hi", sampling=sampling(8), max_tokens=30)))[1].tokens
    assert a == b
    assert a != c


async def test_logit_bias_and_sampler_options(engine: Engine, model: LlamaModel) -> None:
    forced = model.tokenize(" banana", add_special=False)[0]
    sampling = SamplingParams(temperature=0.0, logit_bias={forced: 100.0})
    _, done, _ = await generate(engine, req(model, "Hello", sampling=sampling, max_tokens=5))
    assert set(done.tokens) == {forced}
    # every other option builds a working chain
    for options in (
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.1, typical_p=0.9, seed=1),
        SamplingParams(
            temperature=0.7, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5
        ),
        SamplingParams(temperature=0.7, dry_multiplier=0.8, seed=2),
        SamplingParams(temperature=0.7, mirostat=1, seed=3),
        SamplingParams(temperature=0.7, mirostat=2, seed=4),
    ):
        _, done, _ = await generate(engine, req(model, "Hello", sampling=options, max_tokens=8))
        assert done.usage.completion_tokens == 8, options


async def test_repeat_penalty_changes_greedy_output(engine: Engine, model: LlamaModel) -> None:
    plain = (await generate(engine, req(model, "Hello world", max_tokens=80)))[1].tokens
    assert len(set(plain)) < len(plain), "unpenalised greedy output repeats tokens"
    penalised = SamplingParams(temperature=0.0, presence_penalty=50.0, penalty_last_n=-1)
    tokens = (await generate(engine, req(model, "Hello world", sampling=penalised, max_tokens=80)))[
        1
    ].tokens
    assert len(set(tokens)) == len(tokens), "a presence penalty of 50 forbids any repeat"


async def test_logprobs_report_the_top_alternatives(engine: Engine, model: LlamaModel) -> None:
    sampling = SamplingParams(temperature=0.0, logprobs=3)
    _, _done, deltas = await generate(engine, req(model, "Hello", sampling=sampling, max_tokens=5))
    lps = [lp for d in deltas for lp in d.logprobs]
    assert len(lps) == 5
    for lp in lps:
        assert len(lp.top) == 3
        assert lp.top[0].token == lp.token, "greedy picks the most likely token"
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.logprob <= 0.0


async def test_second_turn_reuses_the_parked_sequence(engine: Engine, model: LlamaModel) -> None:
    session = SessionId("conv-1")
    first = req(model, "Hello world", max_tokens=20, session=session)
    _, done1, _ = await generate(engine, first)
    assert done1.usage.prompt_reused == 0
    # another session runs in between on another sequence
    await generate(engine, req(model, "Unrelated", max_tokens=20, session=SessionId("other")))
    turn2 = [*first.prompt, *done1.tokens, *model.tokenize(" and more", add_special=False)]
    _, done2, _ = await generate(engine, EngineRequest(turn2, max_tokens=5, session=session))
    assert done2.usage.prompt_reused == len(first.prompt) + len(done1.tokens) - 1
    assert done2.usage.prompt_computed == len(turn2) - done2.usage.prompt_reused


async def test_evicted_sequence_is_restored_from_the_state_cache(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=1)).start()
    try:
        a = req(model, "The quick brown fox", max_tokens=30, session=SessionId("a"))
        _, done_a, _ = await generate(e, a)
        # b takes the only sequence: a's state goes to the RAM cache
        await generate(e, req(model, "Lorem ipsum", max_tokens=30, session=SessionId("b")))
        assert len(e.cache) == 1
        turn2 = [*a.prompt, *done_a.tokens, *model.tokenize(" jumps", add_special=False)]
        _, done2, _ = await generate(e, EngineRequest(turn2, max_tokens=10, session=SessionId("a")))
        assert done2.usage.prompt_reused == len(a.prompt) + len(done_a.tokens) - 1
        # and the restored state is right: same output as a cold run
        assert done2.tokens == await cold_answer(model, turn2, 1024, 10)
    finally:
        e.stop()


async def test_a_sessionless_sequence_cut_for_another_request_is_saved(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=1)).start()
    try:
        a = req(model, "The quick brown fox", max_tokens=40)
        _, done_a, _ = await generate(e, a)
        # no session: b still takes the only sequence, and a's cells go to the RAM cache
        await generate(e, req(model, "Lorem ipsum", max_tokens=10))
        assert len(e.cache) == 1
        turn2 = [*a.prompt, *done_a.tokens, *model.tokenize(" again", add_special=False)]
        _, done2, _ = await generate(e, EngineRequest(turn2, max_tokens=5))
        assert done2.usage.prompt_reused == len(a.prompt) + len(done_a.tokens) - 1
    finally:
        e.stop()


async def test_a_request_sharing_a_short_prefix_leaves_the_parked_sequence_whole(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2, max_pins=0)).start()
    cold = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=1, state_cache_bytes=0)).start()
    try:
        system = model.tokenize("You are a careful assistant. " * 6)
        a = EngineRequest([*system, *model.tokenize("Tell a story.", add_special=False)])
        a = dataclasses.replace(a, max_tokens=60)
        _, done_a, _ = await generate(e, a)
        # b shares the system prompt only, less than half of what a's sequence holds:
        # it runs on the empty sequence and shares a's cells for the system prompt
        b = EngineRequest([*system, *model.tokenize("Name a colour.", add_special=False)])
        b = dataclasses.replace(b, max_tokens=12)
        _, done_b, _ = await generate(e, b)
        assert done_b.usage.prompt_reused == common_prefix(a.prompt, b.prompt)
        _, cold_b, _ = await generate(cold, b)
        assert done_b.tokens == cold_b.tokens, "the shared cells give the same output"
        # a's conversation is still whole: its next turn prefills only its new words
        turn2 = [*a.prompt, *done_a.tokens, *model.tokenize(" More.", add_special=False)]
        _, done2, _ = await generate(e, EngineRequest(turn2, max_tokens=5))
        assert done2.usage.prompt_reused == len(a.prompt) + len(done_a.tokens) - 1
        assert len(e.cache) == 0, "nothing had to be saved"
    finally:
        e.stop()
        cold.stop()


async def test_many_parked_cells_move_to_the_state_cache_while_others_run(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=4096, n_seq_max=4)).start()
    try:
        # two parked conversations holding more than PARKED_MAX_CELLS between them
        half = PARKED_MAX_CELLS // 2 + 64
        convs = []
        for topic in ("rivers", "mountains"):
            prompt = model.tokenize(f"Notes on {topic}. " * half)[:half]
            a = EngineRequest(prompt, max_tokens=5)
            convs.append((a, (await generate(e, a))[1]))
        assert len(e.cache) == 0
        # a short request runs: the least recently used conversation goes to the cache,
        # its cells leave the KV; the other stays
        await generate(e, req(model, "Hello", max_tokens=5))
        assert len(e.cache) == 1
        (a, done_a), (b, _) = convs
        held = [s.tokens[:half] for s in e.kv.slots]
        assert a.prompt not in held
        assert b.prompt in held
        # the moved conversation comes back from the cache on its next turn
        turn2 = [*a.prompt, *done_a.tokens, *model.tokenize(" More.", add_special=False)]
        _, done2, _ = await generate(e, EngineRequest(turn2, max_tokens=5))
        assert done2.usage.prompt_reused == len(a.prompt) + len(done_a.tokens) - 1
        assert len(e.cache) == 0
    finally:
        e.stop()


async def test_a_restore_finds_room_the_parked_sequences_it_outgrows_held(
    model: LlamaModel,
) -> None:
    # A conversation's saved state comes back as one contiguous run of cells. Parked
    # sequences over PARKED_MAX_CELLS leave the KV before it is placed, not after: the
    # restore then finds the cells they held (low in the cache) instead of the gaps they
    # left, and it succeeds where the gaps are too small for it.
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2, max_pins=0)).start()
    try:
        short = model.tokenize("Notes on rivers. " * 300)[:800]
        a = EngineRequest(short, max_tokens=5)
        _, done_a, _ = await generate(e, a)
        # a long one fills the rest: the KV runs out mid-prefill, a moves to the cache,
        # and the long one's cells end up on both sides of a gap smaller than a
        long = model.tokenize("Notes on mountains. " * 400)[: PARKED_MAX_CELLS + 276]
        await generate(e, EngineRequest(long, max_tokens=5))
        assert len(e.cache) == 1
        turn2 = [*a.prompt, *done_a.tokens, *model.tokenize(" More.", add_special=False)]
        _, done2, _ = await generate(e, EngineRequest(turn2, max_tokens=5))
        assert done2.usage.prompt_reused == len(a.prompt) + len(done_a.tokens) - 1
        assert done2.tokens == await cold_answer(model, turn2, 2048, 5)
    finally:
        e.stop()


async def test_slow_reader_does_not_stall_the_others(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2)).start()
    try:
        slow = e.submit(req(model, "Hello world", max_tokens=400))
        slow.high_water = 8
        _, fast_done, _ = await generate(e, req(model, "Once upon a time", max_tokens=300))
        assert fast_done.usage.completion_tokens == 300
        assert slow.paused, "the unread stream was paused"
        assert slow.backlog <= 8 + 2, "its backlog stopped growing"
        _, slow_done = await slow.collect()
        assert slow_done.usage.completion_tokens == 400
    finally:
        e.stop()


async def test_injected_crash_fails_every_request_in_flight(model: LlamaModel) -> None:
    crashes: list[BaseException] = []
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2), on_crash=crashes.append).start()
    streams = [e.submit(req(model, p, max_tokens=2000)) for p in PROMPTS]  # 2 run, 2 wait
    for s in streams[:2]:
        await anext(s)
    e.inject_fault(RuntimeError("injected"))
    loop = asyncio.get_running_loop()
    start = loop.time()
    for s in streams:
        with pytest.raises(EngineCrashed, match="injected"):
            await asyncio.wait_for(s.collect(), 2)
    assert loop.time() - start < 2
    assert e._thread is not None
    await asyncio.to_thread(e._thread.join, 5)
    assert [str(c) for c in crashes] == ["injected"]
    with pytest.raises(Exception, match="not running"):
        e.submit(req(model, "again"))
    e.stop()


async def test_embeddings(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=4, embedding=True)).start()
    try:
        texts = ["hello world", "goodbye moon", "hello world", "a b c d e f", "x"]
        vectors = await e.embed([model.tokenize(t) for t in texts])
        assert len(vectors) == 5
        assert all(len(v) == model.n_embd for v in vectors)
        assert all(abs(sum(x * x for x in v) - 1.0) < 1e-6 for v in vectors)
        assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)
        assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
        single = await e.embed([model.tokenize("goodbye moon")])
        assert single[0] == pytest.approx(vectors[1], abs=1e-4), "batching does not change a vector"
        raw = await e.embed([model.tokenize("x")], normalize=False)
        assert abs(sum(x * x for x in raw[0]) - 1.0) > 1e-3
    finally:
        e.stop()


async def test_metrics_by_model(model: LlamaModel) -> None:
    from barrel.metrics import Metrics

    metrics = Metrics()
    e = Engine(
        model, EngineOptions(n_ctx=1024, n_seq_max=2), observer=metrics.engine_observer("tiny")
    )
    e.start()
    try:
        prompt = model.tokenize("Hello world, how are you")
        await generate(e, EngineRequest(prompt, max_tokens=12, session=SessionId("m")))
        await generate(e, EngineRequest(prompt, max_tokens=12, session=SessionId("m")))
    finally:
        e.stop()

    def value(name: str, **labels: str) -> float:
        v = metrics.registry.get_sample_value(name, {"model": "tiny", **labels})
        assert v is not None, name
        return v

    assert value("barrel_engine_generated_tokens_total") == 24
    # the repeat samples its first token from the logits the first prefill left
    assert value("barrel_engine_prompt_tokens_total", source="computed") == len(prompt)
    assert value("barrel_engine_prompt_tokens_total", source="reused") == len(prompt)
    assert value("barrel_engine_requests_total", reason="length") == 2
    assert value("barrel_engine_time_to_first_token_seconds_count") == 2
    assert value("barrel_engine_inter_token_latency_seconds_count") == 22
    assert value("barrel_engine_active_sequences") == 0
    assert value("barrel_engine_kv_cells_used") == len(prompt) + 11
    assert value("barrel_engine_step_duration_seconds_count") >= 12


async def test_pinned_prefix_is_shared_not_prefilled(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2, max_pins=1)).start()
    cold = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2, max_pins=0)).start()
    try:
        system = model.tokenize("You are a careful assistant. " * 30)
        assert await e.pin(system) == len(system)
        assert await e.pin(system) == len(system), "pinning the same prefix again is free"
        outputs = []
        for i, question in enumerate(["What is 2+2?", "Name a colour."]):
            prompt = [*system, *model.tokenize(question, add_special=False)]
            # a new session each time: no parked sequence of its own to reuse
            request = EngineRequest(prompt, max_tokens=12, session=SessionId(f"user{i}"))
            _, done, _ = await generate(e, request)
            assert done.usage.prompt_reused == len(system)
            _, cold_done, _ = await generate(cold, EngineRequest(prompt, max_tokens=12))
            if i == 0:
                assert cold_done.usage.prompt_reused == 0
            assert done.tokens == cold_done.tokens, "the shared cells give the same output"
            outputs.append(done.tokens)
        assert await cold.pin(system) == 0, "no pin sequence configured"
    finally:
        e.stop()
        cold.stop()


async def test_long_prompt_is_chunked_between_decode_steps(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=4096, n_seq_max=2, prefill_chunk=64)).start()
    try:
        running = e.submit(req(model, "Hello world", max_tokens=3000))
        await anext(running)
        long_prompt = model.tokenize("lorem ipsum dolor sit amet " * 300)[:1500]
        seen_before_first_token = 0
        late = e.submit(EngineRequest(long_prompt, max_tokens=3))
        first = asyncio.ensure_future(anext(late))
        while not first.done():
            await anext(running)
            seen_before_first_token += 1
        # 1500 prompt tokens at 64 per step: the running stream got a token every step
        assert seen_before_first_token >= 1500 // 64 - 2
        running.cancel()
        await running.collect()
        _, done = await late.collect()
        assert done.usage.prompt_computed == 1500
    finally:
        e.stop()


async def test_one_loop_wakeup_per_step(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    from barrel.engine import stream as stream_module

    calls: list[int] = []
    real = stream_module.deliver

    def counting(batch: list[tuple[object, list[object]]]) -> None:
        calls.append(len(batch))
        real(batch)  # type: ignore[arg-type]

    monkeypatch.setattr(stream_module, "deliver", counting)
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=4)).start()
    try:
        await asyncio.gather(*(generate(e, req(model, p, max_tokens=30)) for p in PROMPTS))
        steps = e.steps
    finally:
        e.stop()
    assert len(calls) <= steps + 1
    assert max(calls) == 4, "one wake-up carries all four sequences' text"


async def test_kv_full_evicts_parked_sequences_then_fails_the_youngest(model: LlamaModel) -> None:
    e = Engine(model, EngineOptions(n_ctx=256, n_seq_max=3, state_cache_bytes=0)).start()
    try:
        # a parked sequence holds ~150 cells...
        _, parked, _ = await generate(
            e, req(model, "Hello world", max_tokens=150, session=SessionId("p"))
        )
        assert parked.usage.completion_tokens == 150
        # ...and two sequences that each want 150 more cannot both fit in 256: the parked
        # one goes first, then the younger request fails while the older one finishes
        a = e.submit(req(model, "Once upon a time", max_tokens=150))
        await anext(a)
        b = e.submit(req(model, "def f(x):", max_tokens=150))
        results = await asyncio.gather(a.collect(), b.collect(), return_exceptions=True)
        assert not isinstance(results[0], BaseException)
        assert results[0][1].usage.completion_tokens == 150
        from barrel.engine.errors import KVCacheFull

        assert isinstance(results[1], KVCacheFull)
        assert e.alive
        _, again, _ = await generate(e, req(model, "Fresh start", max_tokens=5))
        assert again.usage.completion_tokens == 5
    finally:
        e.stop()


async def test_a_pinned_prefix_gives_way_to_a_request_that_fills_the_context(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=256, n_seq_max=2, max_pins=1)).start()
    try:
        # another client's system prompt holds ~100 cells in the pin sequence...
        other = model.tokenize("You are a careful assistant. " * 15)
        assert await e.pin(other) == len(other)
        # ...and a request that does not share it runs to the end of the context: the
        # pin is a cache and goes, the request is not failed for want of room
        prompt = model.tokenize("Once upon a time")
        _, done, _ = await generate(e, EngineRequest(prompt, max_tokens=1000))
        assert done.finish_reason == "length"
        assert done.usage.prompt_tokens + done.usage.completion_tokens == 256
        assert await e.pin(other) == len(other)  # pinned again on the next ask
    finally:
        e.stop()


async def test_embedding_truncation(model: LlamaModel) -> None:
    # 5 sequences and a 128-token batch would abort llama.cpp: the engine rounds it to 125
    opts = EngineOptions(n_ctx=512, n_batch=128, n_ubatch=128, n_seq_max=5, embedding=True)
    e = Engine(model, opts).start()
    assert e.options.n_ubatch == 125
    try:
        long = model.tokenize("word " * 200)
        with pytest.raises(PromptTooLong):
            e.embed([long])
        (vec,) = await e.embed([long], truncate=True)
        (same,) = await e.embed([long[:125]])
        assert vec == pytest.approx(same, abs=1e-6)
        assert e.count_tokens("word word") == len(model.tokenize("word word"))
    finally:
        e.stop()


async def test_lora_adapter_changes_the_output(model: LlamaModel, tmp_path: Path) -> None:
    from barrel.engine.context import LoraAdapter
    from barrel.store.synthetic import write_tiny_lora

    lora = write_tiny_lora(tmp_path / "tiny-lora.gguf")
    prompt = model.tokenize("Hello world")
    outputs = []
    for loras in ((), (LoraAdapter(lora, 1.0),), (LoraAdapter(lora, 0.0),)):
        e = Engine(model, EngineOptions(n_ctx=512, n_seq_max=1, loras=loras)).start()
        try:
            outputs.append((await generate(e, EngineRequest(prompt, max_tokens=20)))[1].tokens)
        finally:
            e.stop()
    plain, adapted, zero_scale = outputs
    assert adapted != plain
    assert zero_scale == plain


async def test_preserved_control_tokens_are_rendered(engine: Engine, model: LlamaModel) -> None:
    im_start = model.token_id("<|im_start|>")
    assert im_start is not None
    assert model.control_tokens("x<|im_start|>y<tool_call>") == {im_start}
    forced = SamplingParams(temperature=0.0, logit_bias={im_start: 100.0})
    plain, _, _ = await generate(engine, req(model, "Hi", sampling=forced, max_tokens=3))
    shown, _, _ = await generate(
        engine,
        EngineRequest(model.tokenize("Hi"), forced, max_tokens=3, preserve=frozenset({im_start})),
    )
    assert plain == ""
    assert shown == "<|im_start|>" * 3


async def test_prompt_logprobs_match_the_logprobs_of_the_same_tokens_generated(
    model: LlamaModel,
) -> None:
    """Scoring a text (echo + logprobs, max_tokens 0) gives each token the logprob it had
    when it was generated; the whole prompt is computed, in chunks, even when a parked
    sequence holds most of it."""
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=1)).start()
    try:
        prompt = model.tokenize("Once upon a time")
        sampling = SamplingParams(temperature=0.0, logprobs=2)
        _, done, deltas = await generate(e, EngineRequest(prompt, sampling, max_tokens=100))
        generated = [lp for d in deltas for lp in d.logprobs]
        scored = EngineRequest(
            [*prompt, *done.tokens], sampling, max_tokens=0, prompt_logprobs=True
        )
        text, again, _ = await generate(e, scored)
        assert text == ""
        assert again.usage.completion_tokens == 0
        assert again.usage.prompt_reused == 0  # the parked sequence was not used
        assert len(again.prompt_logprobs) == len(prompt) + len(done.tokens) - 1
        tail = again.prompt_logprobs[len(prompt) - 1 :]
        assert [lp.token for lp in tail] == list(done.tokens)
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(tail, generated, strict=True)]
        # batched and one-token decodes round differently: close, not equal (a shift by
        # one position would put every pair far apart)
        assert max(diffs) < 0.1
        assert sum(diffs) / len(diffs) < 0.01
        for mine in tail:  # greedy: each token was (within rounding) the most likely one
            assert len(mine.top) == 2
            assert mine.top[0].logprob - mine.logprob < 0.1
    finally:
        e.stop()


async def test_a_q8_0_kv_cache_holds_a_sequence_in_about_half_the_bytes(
    model: LlamaModel, qwen_path: Path
) -> None:
    import llama_cpp as ll

    from barrel.actors.memory import KV_BYTES
    from barrel.engine.context import KVType

    async def state_bytes(m: LlamaModel, kv_type: KVType) -> int:
        prompt = m.tokenize("The quick brown fox jumps over the lazy dog. " * 20)
        e = Engine(m, EngineOptions(n_ctx=1024, n_seq_max=1, kv_type=kv_type)).start()
        try:
            request = EngineRequest(prompt, max_tokens=8, session=SessionId("s"))
            _, done, _ = await generate(e, request)
            assert done.usage.completion_tokens == 8  # it answers
            (slot,) = e.kv.slots
            # the engine is idle: llama.cpp's own count of the sequence's state bytes
            return int(ll.llama_state_seq_get_size(e.ctx, slot.seq))
        finally:
            await asyncio.to_thread(e.stop)

    qwen = LlamaModel.load(qwen_path)
    try:
        ratio = await state_bytes(qwen, KVType.Q8_0) / await state_bytes(qwen, KVType.F16)
    finally:
        qwen.free()
    # about half, as the memory estimate (and so /api/ps) counts it
    assert ratio == pytest.approx(KV_BYTES["q8_0"] / KV_BYTES["f16"], abs=0.05)
    # the tiny model's heads are not whole q8_0 blocks: it falls back to f16 and serves
    assert await state_bytes(model, KVType.Q8_0) == await state_bytes(model, KVType.F16)
