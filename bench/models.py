"""Load time and single-stream decode speed of the test models, side by side.

    .venv/bin/python -m bench.models

Uses llama-cpp-python's high-level `Llama` with `use_extra_bufts = False` (see
bench/NOTEBOOK.md, "AMX"). Prints one line per model: file size, load seconds,
prompt and generated tokens per second over 128 greedy tokens (median of 3 runs).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama
from llama_cpp import Llama

from barrel.store import bundled
from barrel.store.synthetic import tiny_model

_default = llama_cpp.llama_model_default_params


def _params() -> llama_cpp.llama_model_params:
    p = _default()
    p.use_extra_bufts = False
    return p


def measure(name: str, path: Path, tokens: int = 128, runs: int = 3) -> str:
    llama_cpp.llama.llama_cpp.llama_model_default_params = _params  # type: ignore[attr-defined]
    start = time.perf_counter()
    threads = os.cpu_count() or 1
    llm = Llama(str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    load = time.perf_counter() - start
    speeds = []
    for _ in range(runs):
        llm.reset()
        start = time.perf_counter()
        out: Any = llm.create_completion("def fibonacci(n):", max_tokens=tokens, temperature=0)
        elapsed = time.perf_counter() - start
        speeds.append(out["usage"]["completion_tokens"] / elapsed)
    size = path.stat().st_size / 2**20
    speed = statistics.median(speeds)
    return f"{name:24} {size:8.1f} MiB  load {load:5.2f} s  decode {speed:7.1f} tok/s"


def main() -> None:
    print(measure("tiny (synthetic qwen2)", tiny_model()))
    print(measure("qwen2.5-coder-0.5b", bundled.assemble("qwen2.5-coder-0.5b")))
    print(measure("gemma-3-270m", bundled.assemble("gemma-3-270m")))


if __name__ == "__main__":
    main()
