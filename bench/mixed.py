"""What reading a prompt beside a generating sequence costs, by how its rows are cut into
steps and how many rows the generating sequence brings to each (its pending token and a
draft), on Qwen2.5-Coder-0.5B with llama.cpp's own kernels (the daemon's default), a KV
stream per sequence, without the engine.

    .venv/bin/python -m bench.mixed [--context 1800] [--prompt 1200] [--reps 3]

Sequence 0 holds `--context` cells and generates: each step of a plan adds its rows
(1: a pending token; 16: with a 15-token draft; 0: nothing generates). Sequence 1 reads
a `--prompt`-token prompt in the plan's chunks (one `llama_decode` each). Plans run
interleaved, `--reps` times, and the cells they add are removed after each; the medians
(seconds to read the whole prompt) print as a Markdown table. ggml's CPU flash attention
takes 64 query rows of a KV stream or more in tiles and fewer row by row, at a cost a
row that grows with the cells attended (bench/NOTEBOOK.md, "Issue 45, day three").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import llama_cpp as ll

from barrel.engine.context import Batch, EngineOptions, new_context
from barrel.engine.model import LlamaModel, ModelOptions, configure_kernels
from barrel.store import bundled

N_CTX = 4608
FILL = 512


def plans(prompt: int) -> dict[str, tuple[list[int], int]]:
    """name -> (chunk sizes, the generating sequence's rows a step)."""

    def cut(size: int) -> list[int]:
        return [min(size, prompt - s) for s in range(0, prompt, size)]

    def no_tail(size: int) -> list[int]:
        chunks = cut(size)
        if len(chunks) > 1 and chunks[-1] < 64:
            chunks[-2:] = [chunks[-2] + chunks[-1]]
        return chunks

    return {
        "alone, 512 a step": (cut(512), 0),
        "beside 1 row, 512 a step": (cut(512), 1),
        "beside 1 row, 390 a step": (cut(390), 1),
        "beside 1 row, 390 a step, no short tail": (no_tail(390), 1),
        "beside 4 rows, 390 a step": (cut(390), 4),
        "beside 16 rows, 390 a step": (cut(390), 16),
        "beside 1 row, one step": ([prompt], 1),
    }


class Bench:
    def __init__(self, model: LlamaModel, context: int) -> None:
        opts = EngineOptions(
            n_ctx=N_CTX, n_seq_max=2, max_pins=0, n_batch=2048, n_ubatch=512, kv_per_sequence=True
        )
        self.ctx: Any = new_context(model, opts, N_CTX)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = Batch(2048)
        self.context = context
        for start in range(0, context, FILL):
            end = min(context, start + FILL)
            self.decode([(0, p, 1000 + p % 500, False) for p in range(start, end)])

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> float:
        b = self.batch
        b.clear()
        for seq, pos, token, logits in rows:
            b.add(token, pos, seq, logits)
        start = time.perf_counter()
        if ll.llama_decode(self.ctx, b.raw) != 0:
            raise SystemExit("llama_decode failed: fewer --context or --prompt tokens")
        return time.perf_counter() - start

    def read(self, chunks: list[int], beside: int) -> float:
        total, pos, at = 0.0, 0, self.context
        prompt = sum(chunks)
        for take in chunks:
            rows = [(0, at + j, 3000 + j, True) for j in range(beside)]
            at += beside
            rows += [(1, p, 2000 + p % 700, p == prompt - 1) for p in range(pos, pos + take)]
            total += self.decode(rows)
            pos += take
        ll.llama_memory_seq_rm(self.mem, 1, 0, -1)
        ll.llama_memory_seq_rm(self.mem, 0, self.context, -1)
        return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=1800)
    parser.add_argument("--prompt", type=int, default=1200)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    configure_kernels(False)  # the daemon's default kernels
    model = LlamaModel.load(bundled.assemble("qwen2.5-coder-0.5b"), ModelOptions())
    try:
        bench = Bench(model, args.context)
        todo = plans(args.prompt)
        times: dict[str, list[float]] = {name: [] for name in todo}
        for _ in range(args.reps):
            for name, (chunks, beside) in todo.items():
                times[name].append(bench.read(chunks, beside))
        print(f"| {args.prompt}-token prompt, a stream of {args.context} cells | steps | s |")
        print("|---|---|---|")
        for name, (chunks, _) in todo.items():
            print(f"| {name} | {len(chunks)} | {statistics.median(times[name]):.2f} |")
    finally:
        model.free()


if __name__ == "__main__":
    main()
