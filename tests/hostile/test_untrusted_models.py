"""Untrusted GGUF files: refused with a 400 before they enter the store, and no number
of them uses up a supervisor's restart budget or takes the daemon down."""

from __future__ import annotations

import math
import time
from typing import Any

import gguf
import pytest

from tests.hostile.conftest import Hostile, assert_4xx


def _create(h: Hostile, name: str, file: str) -> Any:
    return h.post("/api/create", json={"model": name, "from": file, "stream": False})


@pytest.mark.slow
def test_metadata_of_the_wrong_type_is_a_400_even_five_times_in_two_seconds(
    hostile: Hostile,
) -> None:
    cases = {
        "ctx.gguf": lambda w, _: w.add_string("qwen2.context_length", "huge"),
        "heads.gguf": lambda w, _: w.add_string("qwen2.attention.head_count", "four"),
        "ftype.gguf": lambda w, _: w.add_float32("general.file_type", math.inf),
        "nan.gguf": lambda w, _: w.add_float32("qwen2.rope.freq_base", math.nan),
        "neg.gguf": lambda w, _: w.add_int64("qwen2.block_count", -3),
    }
    for file, tweak in cases.items():
        hostile.gguf(file, tweak)
    for file in cases:  # 0.4 s apart: what used to exhaust the root's restart intensity
        r = _create(hostile, "bad-" + file.removesuffix(".gguf"), file)
        assert_4xx(r, 400)
        assert "/" not in r.json()["error"], "no server path in the error"
        time.sleep(0.4)
    tags = hostile.post("/api/show", json={"model": "bad-ctx"})
    assert tags.status_code == 404  # nothing half-written
    hostile.still_serving()


def test_a_duplicate_vocabulary_entry_is_a_400_not_an_abort(hostile: Hostile) -> None:
    def duplicate(w: gguf.GGUFWriter, tokens: list[str]) -> None:
        tokens[500] = tokens[400]
        w.add_token_list(tokens)

    hostile.gguf("dup.gguf", duplicate)
    assert_4xx(_create(hostile, "dup", "dup.gguf"), 400, "duplicate")
    hostile.still_serving()


def test_a_truncated_model_is_a_400(hostile: Hostile) -> None:
    whole = hostile.gguf("whole.gguf", lambda w, t: None)
    cut = hostile.imports / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 3])
    assert_4xx(_create(hostile, "cut", "cut.gguf"), 400, "truncated")
    hostile.still_serving()


def test_a_file_llama_cpp_cannot_load_fails_the_create_in_a_child_process(
    hostile: Hostile,
) -> None:
    """Well-formed GGUF, wrong model: a tensor is missing. llama.cpp refuses it in the
    trial load (in a child process), the create is a 400, the daemon never sees it."""

    def missing_tensor(w: gguf.GGUFWriter, _: list[str]) -> None:
        w.add_uint32("qwen2.block_count", 3)  # one block more than the tensors hold

    hostile.gguf("short.gguf", missing_tensor)
    assert_4xx(_create(hostile, "short", "short.gguf"), 400, "cannot be loaded")
    hostile.still_serving()
