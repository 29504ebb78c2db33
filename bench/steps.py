"""What one raw `llama_decode` step costs on Qwen2.5-Coder-0.5B, by its shape, in the
engine's own context settings (barrel.engine.context), variants interleaved so that the
drift of a noisy box falls on all of them alike.

    .venv/bin/python -m bench.steps [--sizes 1,2,4,8,16] [--context 600] [--parked 0]
        [--logits all|last] [--flash auto,off] [--kv f16,q8_0] [--layout unified,split]
        [--streams 4,8] [--extra off,on] [--reps 7]

One sequence holds `--context` tokens and, with `--parked`, another sequence holds that
many more cells (a parked conversation). A step of n tokens continues the first
sequence and is removed again: with `--logits all` every row has logits (a draft being
verified), with `last` only the last (a prefill). `--streams k` also times a step of k
sequences of 200 cells, one token each (k streams generating). Each combination of a
flash-attention setting, a KV cache type and a KV layout gets its own context: `unified`
is the engine's (one KV stream that every sequence shares, 8,192 cells), `split` gives
each sequence a stream of its own (8,192 cells each; `EngineOptions.kv_per_sequence`),
as llama-server runs. Flash attention `auto` is on for a CPU context in the pinned
llama.cpp, `split` included, as in the engine and in llama-server. `--extra off,on`
loads the model twice, without and with llama.cpp's extra (CPU repack) weight buffers
(`ModelOptions.extra_buffers`), and times every variant on both. The medians (ms) print
as a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import llama_cpp as ll

from barrel.engine.context import Batch, EngineOptions, KVType, new_context
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.store import bundled

N_CTX = 8192
STREAM_CELLS = 200
CHUNK = 512


class Variant:
    def __init__(
        self, model: LlamaModel, flash: str, kv: str, layout: str, args: argparse.Namespace
    ) -> None:
        seqs = 2 + max(args.streams, default=0)
        opts = EngineOptions(
            n_ctx=N_CTX,
            n_seq_max=seqs,
            max_pins=0,
            flash_attn=flash,
            kv_type=KVType(kv),
            kv_per_sequence=layout == "split",
        )
        self.name = f"flash_attn {flash}, kv {kv}, {layout}"
        if len(args.extra) > 1:
            self.name += f", extra {'on' if model.options.uses_extra_buffers() else 'off'}"
        if len(args.models) > 1:
            self.name += f", {os.path.basename(model.path)}"
        self.ctx: Any = new_context(model, opts, N_CTX)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = Batch(CHUNK)
        self.times: dict[str, list[float]] = {}
        self.fill(0, args.context)
        if args.parked:
            self.fill(1, args.parked)
        for seq in range(2, seqs):
            self.fill(seq, STREAM_CELLS)

    def decode(self, rows: list[tuple[int, int, bool]], seq_of: list[int]) -> float:
        b = self.batch
        b.clear()
        for (pos, token, logits), seq in zip(rows, seq_of, strict=True):
            b.add(token, pos, seq, logits)
        start = time.perf_counter()
        if ll.llama_decode(self.ctx, b.raw) != 0:
            raise SystemExit("llama_decode failed: fewer --context or --parked cells")
        return (time.perf_counter() - start) * 1000

    def fill(self, seq: int, n: int) -> None:
        for start in range(0, n, CHUNK):
            pos = range(start, min(n, start + CHUNK))
            self.decode([(p, 1000 + p % 500, False) for p in pos], [seq] * len(pos))

    def step(self, n: int, context: int, last_only: bool) -> None:
        rows = [(context + i, 2000 + i, not last_only or i == n - 1) for i in range(n)]
        self.times.setdefault(str(n), []).append(self.decode(rows, [0] * n))
        ll.llama_memory_seq_rm(self.mem, 0, context, -1)

    def streams(self, k: int) -> None:
        rows = [(STREAM_CELLS, 3000, True)] * k
        self.times.setdefault(f"{k}x1", []).append(self.decode(rows, list(range(2, 2 + k))))
        for seq in range(2, 2 + k):
            ll.llama_memory_seq_rm(self.mem, seq, STREAM_CELLS, -1)


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=numbers, default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--parked", type=int, default=0)
    parser.add_argument("--logits", choices=("all", "last"), default="all")
    parser.add_argument("--flash", type=lambda t: t.split(","), default=["auto"])
    parser.add_argument("--kv", type=lambda t: t.split(","), default=["f16"])
    parser.add_argument("--layout", type=lambda t: t.split(","), default=["unified"])
    parser.add_argument("--streams", type=numbers, default=[])
    parser.add_argument("--extra", type=lambda t: t.split(","), default=["off"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", type=lambda t: t.split(","), default=[])
    args = parser.parse_args()
    paths = args.models or [str(bundled.assemble("qwen2.5-coder-0.5b"))]
    extra = {"auto": None, "on": True, "off": False}
    models = [
        LlamaModel.load(path, ModelOptions(extra_buffers=extra[e]))
        for path in paths
        for e in args.extra
    ]
    variants = [
        Variant(model, flash, kv, layout, args)
        for model in models
        for flash in args.flash
        for kv in args.kv
        for layout in args.layout
    ]
    for _ in range(args.reps):
        for n in args.sizes:
            for v in variants:
                v.step(n, args.context, args.logits == "last")
        for k in args.streams:
            for v in variants:
                v.streams(k)
    keys = list(variants[0].times)
    print(
        f"context {args.context}, parked {args.parked}, logits {args.logits}, "
        f"median of {args.reps} (ms)\n"
    )
    print("| tokens | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for v in variants:
        cells = " | ".join(f"{statistics.median(v.times[k]):.1f}" for k in keys)
        print(f"| {v.name} | {cells} |")
        ll.llama_free(v.ctx)
    for model in models:
        model.free()


if __name__ == "__main__":
    main()
