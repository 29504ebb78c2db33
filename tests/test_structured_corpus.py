"""The structured-output corpus (tests/schema_corpus.py) without a model: every schema
compiled by llguidance over the real vocabulary (the tiny model's: Qwen2.5's), the answer
Qwen gave it (recorded by `python -m bench.corpus --record`) accepted token by token,
broken versions of that answer refused, and a refusal naming the unsupported feature
exactly where the daemon refused. tests/test_structured.py runs some of the schemas
through Qwen itself."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from barrel.engine.grammar import Grammars
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.errors import BarrelError
from barrel.pipeline.chat import ChatRequest
from barrel.pipeline.formats import closed, json_schema_grammar
from barrel.pipeline.prompt import forced_schema
from barrel.pipeline.request import Tool, ToolChoice
from tests.schema_corpus import ANSWERS, UNSUPPORTED, corpus

CORPUS = corpus()


@pytest.fixture(scope="module")
def vocab(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path, ModelOptions(vocab_only=True))
    yield m
    m.free()


@pytest.fixture(scope="module")
def answers() -> dict[str, dict[str, Any]]:
    recorded = json.loads(ANSWERS.read_text(encoding="utf-8"))
    names = [name for name, _, _ in CORPUS]
    # a schema added or renamed: run `python -m bench.corpus --record` (Qwen, ~6 min)
    assert [a["name"] for a in recorded] == names, "the corpus changed since it was recorded"
    return {a["name"]: a for a in recorded}


def _asked(schema: dict[str, Any], how: str) -> dict[str, Any]:
    """The schema the daemon's grammar is made of: the response format's, or that of a
    call of the forced tool (bare JSON, as the generic family writes it)."""
    if how == "format":
        return schema
    tool = Tool("fill", "", schema)
    chat = ChatRequest([], tools=(tool,), tool_choice=ToolChoice("required"))
    call = forced_schema(chat)
    assert call is not None
    return call


def _text(document: Any, how: str) -> str:
    """A document as the grammar of `_asked` reads it."""
    whole = document if how == "format" else {"name": "fill", "arguments": document}
    return json.dumps(whole, ensure_ascii=False)


def _grammar(grammars: Grammars, schema: dict[str, Any], how: str) -> str | None:
    """The grammar of what is asked, compiled; None if llguidance refuses it."""
    try:
        grammar = json_schema_grammar(_asked(schema, how))
        grammars.matcher(grammar)
    except BarrelError:
        return None
    return grammar


def _reads(grammars: Grammars, vocab: LlamaModel, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of `text` taken, the grammar complete after them), `text` tokenized
    with the model's vocabulary and fed to the grammar token by token."""
    matcher = grammars.matcher(grammar)
    tokens = vocab.tokenize(text, add_special=False)
    taken = matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error()
    return taken, taken and matcher.is_accepting()


def test_every_schema_compiles_or_is_refused_naming_the_feature(
    vocab: LlamaModel, answers: dict[str, dict[str, Any]]
) -> None:
    grammars = Grammars(vocab)
    refused = []
    for name, schema, how in CORPUS:
        why = ""
        try:
            grammars.matcher(json_schema_grammar(_asked(schema, how)))
        except BarrelError as exc:
            why = str(exc)
        if why:
            assert UNSUPPORTED.search(why), f"{name}: {why}"
            refused.append(name)
        assert answers[name]["status"] == (400 if why else 200), f"{name}: {why}"
    assert 0 < len(refused) < len(CORPUS) // 10  # the unsupported keywords only


def test_every_answer_is_read_token_by_token_through_the_vocabulary(
    vocab: LlamaModel, answers: dict[str, dict[str, Any]]
) -> None:
    grammars = Grammars(vocab)
    read = cut = 0
    for name, schema, how in CORPUS:
        answer = answers[name]
        grammar = _grammar(grammars, schema, how)
        if grammar is None or answer["status"] != 200:
            continue
        if answer["finish"] == "length":  # cut at max_tokens: the start of a document
            taken, _ = _reads(grammars, vocab, grammar, answer["text"])
            assert how != "format" or taken, f"{name}: cut off the grammar"
            cut += 1
            continue
        text = answer["text"] if how == "format" else _text(json.loads(answer["text"]), how)
        assert _reads(grammars, vocab, grammar, text)[1], f"{name}: {text[:200]}"
        jsonschema.validate(json.loads(answer["text"]), schema)
        read += 1
    assert read > len(CORPUS) * 0.85
    assert cut <= len(CORPUS) // 30


def _broken(doc: Any) -> Iterator[Any]:
    """Documents near `doc` that a closed schema of its shape refuses: another key, a
    required key gone, a value of another type, another type whole."""
    if isinstance(doc, dict):
        yield {**doc, "zz_not_in_the_schema": 1}
        for key in list(doc)[:2]:
            yield {k: v for k, v in doc.items() if k != key}
            wrong = copy.deepcopy(doc)
            wrong[key] = {"a": [1]} if not isinstance(doc[key], dict) else "text"
            yield wrong
        yield [doc]
    elif isinstance(doc, list):
        yield {"items": doc}
        yield [*doc, {"zz_not_in_the_schema": [1]}]
    else:
        yield {"value": doc}


def test_broken_answers_are_refused_token_by_token(
    vocab: LlamaModel, answers: dict[str, dict[str, Any]]
) -> None:
    grammars = Grammars(vocab)
    refused = 0
    for name, schema, how in CORPUS:
        answer = answers[name]
        grammar = _grammar(grammars, schema, how)
        if grammar is None or answer["status"] != 200 or answer["finish"] == "length":
            continue
        strict = closed(schema)
        for doc in _broken(json.loads(answer["text"])):
            if jsonschema.validators.validator_for(strict)(strict).is_valid(doc):
                continue  # not broken for this schema
            text = _text(doc, how)
            assert not _reads(grammars, vocab, grammar, text)[1], f"{name} took {text[:200]}"
            refused += 1
    assert refused > len(CORPUS) * 2
