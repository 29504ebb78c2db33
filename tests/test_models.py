"""Test data: the synthetic tiny model and the real bundled models, through llama.cpp."""

from __future__ import annotations

import hashlib
from pathlib import Path

import llama_cpp
import llama_cpp.llama
import pytest
from llama_cpp import Llama

from barrel.store import bundled
from barrel.store.synthetic import TinyShape, write_tiny_gguf


@pytest.fixture(autouse=True)
def _no_extra_buffer_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-cpp-python 0.3.36 built natively on a CPU with AMX repacks Q4_K weights into
    AMX buffers and then segfaults in llama_decode. Barrel's engine loads models with
    `use_extra_bufts = False`; the high-level `Llama` used by these smoke tests has no
    such argument, so its default model params are patched here."""
    default = llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", params)


def test_tiny_model_is_small_with_qwen_tokenizer_and_tool_template(
    tiny_path: Path, qwen_path: Path
) -> None:
    assert tiny_path.stat().st_size < 30 * 1024 * 1024
    tiny = Llama(str(tiny_path), n_ctx=512, verbose=False)
    assert tiny.metadata["general.architecture"] == "qwen2"
    template = tiny.metadata["tokenizer.chat_template"]
    assert "tools" in template
    assert "<tool_call>" in template

    real_vocab = Llama(str(qwen_path), vocab_only=True, verbose=False)
    text = "def hello():\n    return 'héllo wörld' 🚀"
    assert tiny.tokenize(text.encode()) == real_vocab.tokenize(text.encode())
    assert tiny.n_vocab() == real_vocab.n_vocab() == 151936


def test_tiny_model_generates_deterministically(tiny_path: Path) -> None:
    llm = Llama(str(tiny_path), n_ctx=512, verbose=False, seed=1)
    first = llm.create_completion("Once upon a time", max_tokens=64, temperature=0)
    llm.reset()
    second = llm.create_completion("Once upon a time", max_tokens=64, temperature=0)
    assert first["usage"]["completion_tokens"] == 64
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_tiny_model_file_is_reproducible(tmp_path: Path, qwen_path: Path, tiny_path: Path) -> None:
    again = write_tiny_gguf(tmp_path / "again.gguf", qwen_path, TinyShape())
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(tiny_path)
    assert not list(tmp_path.glob(".*.tmp")), "no temp file left behind"


@pytest.mark.real_model
def test_qwen_demo_model_answers(qwen_path: Path) -> None:
    llm = Llama(str(qwen_path), n_ctx=1024, verbose=False)
    out = llm.create_chat_completion(
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        max_tokens=32,
        temperature=0,
    )
    answer = out["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


@pytest.mark.real_model
def test_gemma_model_generates(gemma_path: Path) -> None:
    llm = Llama(str(gemma_path), n_ctx=512, verbose=False)
    out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
    assert out["usage"]["completion_tokens"] > 0
    assert out["choices"][0]["text"].strip()


def test_assembly_checks_the_digest_and_leaves_nothing_on_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = [tmp_path / "p1", tmp_path / "p2"]
    parts[0].write_bytes(b"GGUF" + b"a" * 100)
    parts[1].write_bytes(b"b" * 100)
    good = hashlib.sha256(b"GGUF" + b"a" * 100 + b"b" * 100).hexdigest()
    dest = tmp_path / "cache"
    monkeypatch.setitem(
        bundled.MODELS, "fake", bundled.Bundled("fake", "fake.gguf", good, lambda: parts)
    )
    path = bundled.assemble("fake", dest)
    assert path.read_bytes()[:4] == b"GGUF"
    assert path.stat().st_size == 204
    # a later call trusts the stamp and does not read the parts again
    monkeypatch.setitem(
        bundled.MODELS, "fake", bundled.Bundled("fake", "fake.gguf", good, lambda: [])
    )
    assert bundled.assemble("fake", dest) == path

    monkeypatch.setitem(
        bundled.MODELS, "bad", bundled.Bundled("bad", "bad.gguf", "0" * 64, lambda: parts)
    )
    with pytest.raises(bundled.AssemblyError, match="sha256"):
        bundled.assemble("bad", dest)
    assert sorted(p.name for p in dest.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]
    with pytest.raises(bundled.AssemblyError, match="unknown bundled model"):
        bundled.assemble("nope", dest)
