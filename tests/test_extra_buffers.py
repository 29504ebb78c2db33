"""llama.cpp's extra (CPU repack) weight buffers: `ModelOptions.extra_buffers` and the
config key `models.defaults.extra_buffers`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from barrel.engine import model as kernels
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel, ModelOptions, cpu_has_amx
from barrel.engine.types import GREEDY, EngineRequest
from tests.test_lifecycle import MakeClient, start

REPACKED = "CPU_REPACK model buffer size"
# llama.cpp offers its first extra buffer type: AMX's where the CPU has AMX
OFFERED = "preferred buffer type " + ("AMX" if cpu_has_amx() else "CPU_REPACK")

QUESTION = (
    "<|im_start|>user\nWhat is the capital of France? Answer with one word.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _load(caplog: pytest.LogCaptureFixture, path: Path, opts: ModelOptions) -> LlamaModel:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="barrel.llama"):
        return LlamaModel.load(path, opts)


async def _answers(model: LlamaModel) -> None:
    """The model decodes, and answers the question right."""
    engine = Engine(model, EngineOptions(n_ctx=512, n_seq_max=1)).start()
    try:
        request = EngineRequest(model.tokenize(QUESTION), max_tokens=4, sampling=GREEDY)
        _, done = await engine.submit(request).collect()
        assert "Paris" in model.detokenize(list(done.tokens))
    finally:
        await asyncio.to_thread(engine.stop)


@pytest.mark.real_model
async def test_auto_repacks_qwens_q4_k_weights_and_the_model_answers(
    qwen_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off in the library's default. "auto" (None) follows the process's kernels: with
    batch-invariant ones it repacks nothing; with llama.cpp's it puts Qwen's Q4_K tensors
    in a repack buffer unless the CPU has AMX, and the model still answers."""
    _load(caplog, qwen_path, ModelOptions()).free()
    assert REPACKED not in caplog.text
    monkeypatch.setattr(kernels, "_batch_invariant", True)
    _load(caplog, qwen_path, ModelOptions(extra_buffers=None)).free()
    assert REPACKED not in caplog.text
    monkeypatch.setattr(kernels, "_batch_invariant", False)
    model = _load(caplog, qwen_path, ModelOptions(extra_buffers=None))
    try:
        assert (REPACKED in caplog.text) == (not cpu_has_amx())
        await _answers(model)
    finally:
        model.free()


@pytest.mark.parametrize("extra", [False, True])
async def test_the_config_key_reaches_the_load(
    aiohttp_client: MakeClient,
    tmp_path: Path,
    tiny_path: Path,
    caplog: pytest.LogCaptureFixture,
    extra: bool,
) -> None:
    """`models.defaults.extra_buffers` decides whether llama.cpp is offered the repack
    buffers at load (never on a CPU with AMX: see the next test), and the model answers
    either way."""
    with caplog.at_level(logging.DEBUG, logger="barrel.llama"):
        _, lc = await start(
            aiohttp_client, tmp_path, {"tiny": tiny_path}, defaults={"extra_buffers": extra}
        )
        lease = await lc.acquire("tiny", keep_alive=60)
    assert (OFFERED in caplog.text) == (extra and not cpu_has_amx())
    request = EngineRequest(lease.engine.tokenize("Hi"), max_tokens=3)
    _, done = await lease.engine.submit(request).collect()
    assert done.usage.completion_tokens == 3
    await lc.release(lease)


def test_a_cpu_with_amx_never_gets_extra_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU with AMX the pinned llama.cpp puts K-quant weights in AMX buffers and the
    process dies at its first decode: neither "auto" nor true offers them there."""
    monkeypatch.setattr(kernels, "_batch_invariant", False)
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: False)
    assert ModelOptions(extra_buffers=True).uses_extra_buffers()
    assert ModelOptions(extra_buffers=None).uses_extra_buffers()
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: True)
    assert not ModelOptions(extra_buffers=True).uses_extra_buffers()
    assert not ModelOptions(extra_buffers=None).uses_extra_buffers()
    assert not ModelOptions(extra_buffers=False).uses_extra_buffers()


@pytest.mark.real_model
async def test_qwen_asked_for_extra_buffers_answers_on_this_cpu(
    qwen_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`extra_buffers = true` loads Qwen with repacked weights where the CPU has no AMX;
    on a CPU with AMX (where they killed the process at the first decode) it loads it
    without them and says so. Either way the model answers."""
    model = _load(caplog, qwen_path, ModelOptions(extra_buffers=True))
    try:
        assert (REPACKED in caplog.text) == (not cpu_has_amx())
        assert ("the CPU has AMX" in caplog.text) == cpu_has_amx()
        await _answers(model)
    finally:
        model.free()
