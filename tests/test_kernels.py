"""Which CPU kernels a daemon runs: llama.cpp's own by default (faster prompts), or
batch-invariant ones when asked (a greedy answer independent of its step's neighbours).
The rest of the suite runs batch-invariant (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from barrel.engine import model as kernels
from barrel.engine.context import KVType, flash_attention
from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import BATCH_INVARIANT_ENV, LlamaModel, ModelOptions, cpu_has_amx
from barrel.engine.types import EngineRequest, SamplingParams
from tests.daemon import Daemon


def test_the_environment_wins_over_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
        assert kernels.configure_kernels(False) is True
        assert ModelOptions(extra_buffers=None).uses_extra_buffers() is False
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
        assert kernels.configure_kernels(True) is False
        # "auto" repacks the weights with llama.cpp's kernels, except where AMX crashes
        assert ModelOptions(extra_buffers=None).uses_extra_buffers() is not cpu_has_amx()
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "")
        assert kernels.configure_kernels(False) is False
        # asked for, except where AMX crashes (tests/test_extra_buffers.py)
        assert ModelOptions(extra_buffers=True).uses_extra_buffers() is not cpu_has_amx()
        assert ModelOptions().uses_extra_buffers() is False  # the library's default
    finally:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
        kernels.configure_kernels(True)
    assert kernels.batch_invariant()


def _daemon(tmp: Path, model: Path, models_toml: str) -> Daemon:
    config = tmp / "barrel.toml"
    config.write_text(f'[models]\ncache_root = "{tmp / "cache"}"\n{models_toml}\n')
    # no word from the environment: the configuration decides (ggml's own default for
    # the tiled matmul, which this test process pinned off for its children)
    env = {BATCH_INVARIANT_ENV: "", "GGML_CPU_TILED_MM": "1"}
    d = Daemon(
        "--config", str(config), "--model", f"m={model}", "--log-level", "info", cwd=tmp, env=env
    )
    d.wait_listening()
    return d


@pytest.mark.real_model
def test_a_default_daemon_answers_with_llama_cpp_s_kernels(tmp_path: Path, qwen_path: Path) -> None:
    d = _daemon(tmp_path, qwen_path, "")
    try:
        d.wait_line(r"kernels: llama\.cpp's")
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", timeout=120)
        answer = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is 2+2? Answer with the number only."}],
            temperature=0,
            max_tokens=8,
        )
        assert "4" in (answer.choices[0].message.content or "")
        status = httpx.get(d.url + "/api/status", timeout=30).json()
        assert status["batch_invariant"] is False
    finally:
        d.kill()


def test_batch_invariance_is_a_setting(tmp_path: Path, tiny_path: Path) -> None:
    d = _daemon(tmp_path, tiny_path, "batch_invariant = true")
    try:
        d.wait_line(r"kernels: batch-invariant")
        status = httpx.get(d.url + "/api/status", timeout=30).json()
        assert status["batch_invariant"] is True
    finally:
        d.kill()


async def test_a_prompt_s_last_token_decoded_alone_rounds_as_in_the_whole_prompt(
    qwen_path: Path,
) -> None:
    """Batch-invariant (this process): the last token of a 350-token prompt decoded alone,
    after the rest was cached, gives the logits it has in the step of the whole prompt, so
    the answers are the same bit for bit. With flash attention on, ggml's CPU kernel takes
    the two rows down different paths (the tiled one for 64 rows or more) and they were
    0.33 apart, and these answers' logprobs differed (`flash_attention`)."""
    model = LlamaModel.load(qwen_path)
    system = "You are a helpful assistant with tools. " * 40
    prompt = model.tokenize(
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWrite a poem about the "
        "sea.<|im_end|>\n<|im_start|>assistant\n"
    )
    greedy = SamplingParams(temperature=0, logprobs=0)
    opts = EngineOptions(n_ctx=1024, n_seq_max=1, speculation="off")

    async def answer(cached: list[int] | None) -> tuple[list[float], int]:
        engine = Engine(model, opts).start()
        try:
            if cached is not None:
                await engine.submit(EngineRequest(cached, max_tokens=1)).collect()
            deltas, done = await engine.submit(EngineRequest(prompt, greedy, 8)).collect()
            return [lp.logprob for d in deltas for lp in d.logprobs], done.usage.prompt_computed
        finally:
            await asyncio.to_thread(engine.stop)

    try:
        assert flash_attention(opts) == "off"
        cold, computed = await answer(None)
        alone, computed_alone = await answer(prompt[:-1])
        assert (computed, computed_alone) == (len(prompt), 1)
        assert alone == cold  # bit for bit
    finally:
        model.free()


def test_flash_attention_is_off_only_where_the_daemon_is_batch_invariant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert kernels.batch_invariant()  # this process (tests/conftest.py)
    assert flash_attention(EngineOptions()) == "off"
    assert flash_attention(EngineOptions(flash_attn="on")) == "on"  # asked for: kept
    assert flash_attention(EngineOptions(kv_type=KVType.Q8_0)) == "auto"  # V needs it
    try:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
        kernels.configure_kernels(False)
        assert flash_attention(EngineOptions()) == "auto"  # llama.cpp's kernels: its choice
    finally:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
        kernels.configure_kernels(True)
    assert kernels.batch_invariant()
