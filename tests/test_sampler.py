"""Greedy sampling without llama.cpp's chain: the same token, found by numpy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp as ll
import msgspec
import numpy as np
import pytest

from barrel.engine import sampler as sampler_module
from barrel.engine.context import Batch, EngineOptions, new_context
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.engine.sampler import LogitRows, Sampler
from barrel.engine.types import GREEDY

PROMPT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints"


@pytest.fixture(scope="module")
def decoded(qwen_path: Path) -> Iterator[tuple[LlamaModel, Any, int]]:
    """Qwen with a prompt decoded, every row with logits: (model, context, rows)."""
    model = LlamaModel.load(qwen_path)
    ctx = new_context(model, EngineOptions(n_ctx=256, n_seq_max=1), 256)
    tokens = model.tokenize(PROMPT)
    batch = Batch(64)
    for pos, token in enumerate(tokens):
        batch.add(token, pos, 0, True)
    assert ll.llama_decode(ctx, batch.raw) == 0
    yield model, ctx, len(tokens)
    ll.llama_free(ctx)
    model.free()


def chain_greedy(logits: np.ndarray) -> int:
    """llama.cpp's own greedy sampler over a row of logits."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
    cur = np.empty(len(logits), dtype=sampler_module.TOKEN_DATA)
    cur["id"] = np.arange(len(logits), dtype=np.int32)
    cur["logit"] = logits
    cur["p"] = 0.0
    arr = ll.llama_token_data_array(cur.ctypes.data_as(ll.llama_token_data_p), len(cur), -1, False)
    ll.llama_sampler_apply(chain, arr)
    token = int(cur["id"][arr.selected])
    ll.llama_sampler_free(chain)
    return token


def counting_chain(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls into llama.cpp's sampler chain (the real one still runs)."""
    calls: list[int] = []
    real = ll.llama_sampler_sample

    def spy(chain: Any, ctx: Any, index: int) -> int:
        calls.append(index)
        return int(real(chain, ctx, index))

    monkeypatch.setattr(sampler_module.ll, "llama_sampler_sample", spy)
    return calls


def test_logit_rows_are_the_contexts_rows_and_follow_a_new_decode(
    decoded: tuple[LlamaModel, Any, int],
) -> None:
    """Each row's view holds exactly what llama.cpp returns for that row. After another
    decode, the same lookups show the new logits: a view is the row, never a copy."""
    model = decoded[0]
    ctx = new_context(model, EngineOptions(n_ctx=256, n_seq_max=1), 256)
    batch = Batch(64)
    try:
        tokens = model.tokenize(PROMPT)
        for pos, token in enumerate(tokens):
            batch.add(token, pos, 0, True)
        assert ll.llama_decode(ctx, batch.raw) == 0
        views = LogitRows(model.n_vocab)
        for row in range(len(tokens)):
            want = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row), shape=(model.n_vocab,))
            got = views(ctx, row)
            assert got.shape == (model.n_vocab,)
            assert np.array_equal(got, want)
            assert views(ctx, row) is got  # cached by address
        before = views(ctx, 0).copy()
        batch.clear()
        batch.add(model.tokenize(" lighthouse")[0], len(tokens), 0, True)
        assert ll.llama_decode(ctx, batch.raw) == 0
        again = views(ctx, 0)
        fresh = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, 0), shape=(model.n_vocab,))
        assert np.array_equal(again, fresh)
        assert not np.array_equal(again, before)
    finally:
        batch.free()
        ll.llama_free(ctx)


def test_logit_rows_refuse_a_row_without_logits(decoded: tuple[LlamaModel, Any, int]) -> None:
    model, ctx, rows = decoded
    with pytest.raises(RuntimeError, match="no logits"):
        LogitRows(model.n_vocab)(ctx, rows + 5)


def test_plain_greedy_takes_the_chains_token_without_the_chain(
    decoded: tuple[LlamaModel, Any, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ctx, rows = decoded
    calls = counting_chain(monkeypatch)
    fast = Sampler(model, GREEDY, 256)
    try:
        for row in range(rows):
            logits = LogitRows(model.n_vocab)(ctx, row).copy()
            assert fast.sample(ctx, row) == chain_greedy(logits)
            assert fast.sample_from(logits) == chain_greedy(logits)
    finally:
        fast.free()
    assert calls == []  # never through the chain


def test_ties_go_to_the_first_token_as_in_the_chain(qwen_path: Path) -> None:
    model = LlamaModel.load(qwen_path, ModelOptions(vocab_only=True))
    fast = Sampler(model, GREEDY, 256)
    try:
        logits = np.zeros(model.n_vocab, dtype=np.float32)
        logits[[7, 900, 151_000]] = 3.5
        assert fast.sample_from(logits) == chain_greedy(logits) == 7
    finally:
        fast.free()
        model.free()


def test_greedy_with_a_penalty_still_runs_the_chain(
    decoded: tuple[LlamaModel, Any, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeat penalty changes the logits before the greedy pick: that is the chain's
    work, so such a sequence keeps going through it."""
    model, ctx, rows = decoded
    calls = counting_chain(monkeypatch)
    penalised = Sampler(model, msgspec.structs.replace(GREEDY, repeat_penalty=1.3), 256)
    try:
        penalised.sample(ctx, rows - 1)
    finally:
        penalised.free()
    assert calls == [rows - 1]
