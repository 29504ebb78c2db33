"""ggml's CPU tiled K-quant matmul is off in the engine (`GGML_CPU_TILED_MM=0` unless the
environment sets it): Qwen's Q4_K and Q6_K weights then go through the same per-row dot products
in a step of one row and in a step of eight, so a sequence's logits do not depend on how
many others share its steps. ggml reads the variable once per process, so the setting a
user gives is checked in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import TILED_MATMUL_ENV, LlamaModel
from barrel.engine.types import EngineRequest, SamplingParams

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, logprobs=0)  # the chosen token's logprob
TOPICS = ["rivers", "bridges", "clocks", "owls", "maps", "salt", "kites", "bells"]


async def _logprobs(path: Path) -> dict[str, list[float]]:
    """The chosen tokens' logprobs of the first prompt alone, and beside seven others
    (steps of eight rows once all of them generate)."""
    model = LlamaModel.load(path)
    asked = "<|im_start|>user\nSay something about {}.<|im_end|>\n<|im_start|>assistant\n"
    prompts = [model.tokenize(asked.format(t)) for t in TOPICS]
    opts = EngineOptions(n_ctx=4096, n_seq_max=8, kv_per_sequence=True, speculation="off")
    engine = Engine(model, opts).start()
    try:

        async def ask(prompt: list[int]) -> list[float]:
            req = EngineRequest(prompt, max_tokens=24, sampling=GREEDY)
            deltas, _ = await engine.submit(req).collect()
            return [lp.logprob for d in deltas for lp in d.logprobs]

        alone = await ask(prompts[0])
        together = await asyncio.gather(*(ask(p) for p in prompts))
        return {"alone": alone, "together": together[0]}
    finally:
        await asyncio.to_thread(engine.stop)
        model.free()


def _in_child(path: Path, tiled: str | None) -> dict[str, list[float]]:
    env = {k: v for k, v in os.environ.items() if k != TILED_MATMUL_ENV}
    if tiled is not None:
        env[TILED_MATMUL_ENV] = tiled
    code = (
        "import asyncio, json, sys; from pathlib import Path; "
        "from tests.test_tiled_matmul import _logprobs; "
        "print(json.dumps(asyncio.run(_logprobs(Path(sys.argv[1])))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, list[float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_a_sequences_logprobs_are_the_same_alone_and_beside_seven_others(
    qwen_path: Path,
) -> None:
    got = _in_child(qwen_path, None)
    assert len(got["alone"]) == 24
    assert got["together"] == got["alone"]  # bit for bit


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((set(line.split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="no tiled path in ggml here")
def test_a_tiled_matmul_the_user_asks_for_is_honoured(qwen_path: Path) -> None:
    """With llama.cpp's own default (tiled on), the eight-row steps round Q4_K products
    differently from the one-row steps: the same logprobs are no longer the same."""
    got = _in_child(qwen_path, "1")
    assert len(got["alone"]) == len(got["together"]) == 24
    assert got["together"] != got["alone"]
