"""The engine under an llguidance grammar (barrel.engine.grammar): the mask, the end of a
grammar ending the sequence, forced tokens appended without sampling, llguidance's
limits failing only their own sequence. Tiny model: its output is near random, so a
valid document is the grammar's doing."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.errors import InvalidGrammar
from barrel.engine.model import LlamaModel
from barrel.engine.observer import NoObserver
from barrel.engine.types import GREEDY, Done, EngineRequest, FinishReason, SamplingParams
from barrel.pipeline.formats import choice_lark, json_schema_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "count", "tags"],
}


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


async def run(
    engine: Engine, model: LlamaModel, grammar: str, **sampling: object
) -> tuple[str, Done]:
    params = SamplingParams(grammar=grammar, **sampling)  # type: ignore[arg-type]
    request = EngineRequest(model.tokenize("Answer:"), params, max_tokens=300)
    deltas, done = await engine.submit(request).collect()
    return "".join(d.text for d in deltas), done


async def test_greedy_and_sampled_output_validate_and_the_grammar_s_end_ends_them(
    engine: Engine, model: LlamaModel
) -> None:
    grammar = json_schema_grammar(SCHEMA)
    answers = [await run(engine, model, grammar, temperature=0.0)]
    answers += await asyncio.gather(
        *(run(engine, model, grammar, temperature=1.0, seed=s) for s in range(8))
    )
    for text, done in answers:
        document = json.loads(text)  # nothing after the closing brace
        jsonschema.validate(document, SCHEMA)
        assert set(document) == set(SCHEMA["properties"])  # objects closed
        assert done.finish_reason is FinishReason.STOP
        # the sequence ended at the grammar's end, without sampling an end token
        assert not model.is_eog(done.tokens[-1])
    assert len({text for text, _ in answers}) > 1


async def test_forced_tokens_are_appended_without_sampling(
    engine: Engine, model: LlamaModel
) -> None:
    text, done = await run(engine, model, json_schema_grammar(SCHEMA), temperature=0.0)
    assert engine.verifier is not None
    # keys of a fixed schema are forced: `"name":`, `"kind":`, ...
    assert engine.verifier.forced_tokens > 0
    assert engine.verifier.forced_tokens < len(done.tokens)
    jsonschema.validate(json.loads(text), SCHEMA)


class StepSizes(NoObserver):
    """The rows of each decoded step."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        self.rows.append(tokens)


async def test_the_grammar_s_forced_start_is_read_with_the_prompt(model: LlamaModel) -> None:
    sizes = StepSizes()
    engine = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=2), observer=sizes).start()
    try:
        grammar = json_schema_grammar(SCHEMA)
        start = engine.grammars.matcher(grammar).compute_ff_tokens()  # `{"name":`
        assert len(start) > 1
        params = SamplingParams(grammar=grammar, temperature=0.0)
        prompt = model.tokenize("Answer:")
        request = EngineRequest(prompt, params, max_tokens=300)
        deltas, done = await engine.submit(request).collect()
        # the step that read the prompt decoded the forced start after it, and the
        # first token sampled came from that step
        assert sizes.rows[0] == len(prompt) + len(start)
        assert list(done.tokens[: len(start)]) == start
        assert engine.verifier is not None
        assert engine.verifier.forced_tokens >= len(start)
        jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)
        # as many as the request allows: the forced start is output like any token
        for limit in (1, 2):
            request = EngineRequest(prompt, params, max_tokens=limit)
            _, done = await engine.submit(request).collect()
            assert list(done.tokens) == start[:limit]
            assert done.finish_reason is FinishReason.LENGTH
    finally:
        await asyncio.to_thread(engine.stop)


async def test_a_forced_start_fits_a_step_that_other_prompts_fill(model: LlamaModel) -> None:
    """Two prompts read in one step, the first under a grammar: its forced start is
    decoded after its last token, and the second prompt's rows still fit the batch (the
    start takes the rows left over, never more). The second prompt is read whole in that
    step, filling it: a step that ends a prompt takes later ones only whole
    (`Planner._in_order`)."""
    options = EngineOptions(n_ctx=2048, n_seq_max=2, n_batch=32, n_ubatch=32, gather_s=30.0)
    sizes = StepSizes()
    engine = Engine(model, options, observer=sizes).start()
    try:
        grammar = json_schema_grammar(SCHEMA)
        params = SamplingParams(grammar=grammar, temperature=0.0)
        engine.expect(2)  # both join the first step
        first = model.tokenize("Answer:")
        constrained = engine.submit(EngineRequest(first, params, 40))
        rest = model.tokenize(" ".join(["word"] * 60))[: 32 - len(first)]
        plain = engine.submit(EngineRequest(rest, GREEDY, max_tokens=4))
        deltas, done = await constrained.collect()
        _, other = await plain.collect()
        jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)
        assert done.finish_reason is FinishReason.STOP
        assert len(other.tokens) == 4
        assert sizes.rows[0] == 32  # the first step was full
    finally:
        await asyncio.to_thread(engine.stop)


async def test_regex_and_choice_grammars(engine: Engine, model: LlamaModel) -> None:
    regex = str(LLMatcher.grammar_from_regex(r"[0-9]{3}-[a-z]{2}"))
    text, _ = await run(engine, model, regex, temperature=1.0, seed=3)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    choice = str(LLMatcher.grammar_from_lark(choice_lark(("red", "green", "blue"))))
    text, _ = await run(engine, model, choice, temperature=1.0, seed=5)
    assert text in ("red", "green", "blue")


async def test_a_refused_grammar_fails_before_it_is_queued(
    engine: Engine, model: LlamaModel
) -> None:
    bad = str(LLMatcher.grammar_from_lark("start: undefined_rule\n"))
    with pytest.raises(InvalidGrammar, match="undefined_rule"):
        engine.grammars.matcher(bad)
    with pytest.raises(InvalidGrammar):
        await run(engine, model, bad)
    # the engine serves on
    text, _ = await run(engine, model, json_schema_grammar({"type": "boolean"}))
    assert text in ("true", "false")


async def test_a_grammar_is_compiled_once_and_each_sequence_gets_a_copy(engine: Engine) -> None:
    grammar = json_schema_grammar({**SCHEMA, "title": "compiled once"})
    before = engine.grammars.compiles
    a = engine.grammars.matcher(grammar)
    b = engine.grammars.matcher(grammar)
    assert engine.grammars.compiles == before + 1
    assert a is not b
    start = b.compute_ff_tokens()
    assert a.consume_token(start[0])
    assert b.compute_ff_tokens() == start  # a's token is not b's


MALFORMED = [
    {"allOf": [{"properties": [{"a": 1}]}]},
    {"properties": "x"},
    {"type": "object", "required": "x"},
    {"$ref": 5},
    {"enum": 3},
    {"items": [[[]]]},
    {"type": "strnig"},
    {"minLength": -1, "type": "string"},
]


@pytest.mark.parametrize("schema", MALFORMED, ids=[json.dumps(s)[:30] for s in MALFORMED])
def test_a_malformed_schema_is_refused_with_a_reason(engine: Engine, schema: object) -> None:
    with pytest.raises(InvalidGrammar, match=r"schema or grammar cannot be used: .+"):
        engine.grammars.matcher(json_schema_grammar(schema))  # type: ignore[arg-type]


async def test_a_grammar_that_allows_nothing_fails_its_sequence_alone(
    engine: Engine, model: LlamaModel
) -> None:
    # compiles, but no token can ever start it
    loop = json_schema_grammar(
        {"$ref": "#/$defs/loop", "$defs": {"loop": {"$ref": "#/$defs/loop"}}}
    )
    plain = EngineRequest(model.tokenize("Hello"), max_tokens=8)
    stuck, served = await asyncio.gather(
        run(engine, model, loop), engine.submit(plain).collect(), return_exceptions=True
    )
    assert isinstance(stuck, InvalidGrammar), stuck
    assert not isinstance(served, BaseException)
    assert len(served[1].tokens) == 8
