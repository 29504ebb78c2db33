"""Whether one row's logits are bit-identical decoded alone and beside other sequences'
rows, on Qwen2.5-Coder-0.5B with the batch-invariant kernels (no tiled matmul, no
repacked weights), by flash-attention setting, KV layout and context length: which of
llama.cpp's CPU kernel paths a step's shape picks, without the engine.

    .venv/bin/python -m bench.rows [--flash on,off] [--layout split,unified]
        [--context 200,700]

Three sequences each hold `--context` cells; a token continuing sequence 0 is decoded
alone, again alone, beside a token of sequence 1, and beside tokens of sequences 1 and
2 (each step's cells removed after it). Nothing here is timed. The CPU flash-attention
kernel takes a lone query row over 512 cells or more in KV chunks, one per thread, and
any other shape whole (bench/NOTEBOOK.md, "Which kernel paths break invariance").
"""

from __future__ import annotations

import argparse
import os

import llama_cpp as ll
import numpy as np

from barrel.engine.context import Batch, EngineOptions, new_context
from barrel.engine.model import BATCH_INVARIANT_ENV, LlamaModel, ModelOptions, configure_kernels
from barrel.store import bundled

N_CTX = 4096
CHUNK = 256
SEQS = 3


def compare(model: LlamaModel, flash: str, split: bool, cells: int) -> str:
    opts = EngineOptions(
        n_ctx=N_CTX, n_seq_max=SEQS, max_pins=0, flash_attn=flash, kv_per_sequence=split
    )
    ctx = new_context(model, opts, N_CTX)
    mem = ll.llama_get_memory(ctx)
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model.handle))
    batch = Batch(CHUNK)

    def decode(rows: list[tuple[int, int, int]]) -> np.ndarray:
        """Decode (token, pos, seq) rows; the first row's logits."""
        batch.clear()
        indices = [batch.add(token, pos, seq, True) for token, pos, seq in rows]
        if ll.llama_decode(ctx, batch.raw) != 0:
            raise SystemExit("llama_decode failed")
        logits = ll.llama_get_logits_ith(ctx, indices[0])
        return np.ctypeslib.as_array(logits, shape=(n_vocab,)).copy()

    def step(neighbours: int) -> np.ndarray:
        rows = [(2000 + seq, cells, seq) for seq in range(neighbours + 1)]
        out = decode(rows)
        for seq in range(neighbours + 1):
            ll.llama_memory_seq_rm(mem, seq, cells, -1)
        return out

    try:
        for seq in range(SEQS):
            for start in range(0, cells, CHUNK):
                end = min(cells, start + CHUNK)
                decode([(1000 + p % 500, p, seq) for p in range(start, end)])
        alone, again, beside1, beside2 = step(0), step(0), step(1), step(2)
    finally:
        batch.free()
        ll.llama_free(ctx)
    layout = "split" if split else "unified"
    return (
        f"| {flash} | {layout} | {cells} | {np.array_equal(alone, again)} | "
        f"{np.array_equal(alone, beside1)} | {np.array_equal(alone, beside2)} | "
        f"{float(np.abs(alone - beside1).max()):.2e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flash", type=lambda t: t.split(","), default=["on", "off"])
    parser.add_argument("--layout", type=lambda t: t.split(","), default=["split", "unified"])
    parser.add_argument(
        "--context", type=lambda t: [int(x) for x in t.split(",")], default=[200, 700]
    )
    args = parser.parse_args()
    os.environ[BATCH_INVARIANT_ENV] = "1"
    configure_kernels(True)
    path = bundled.assemble("qwen2.5-coder-0.5b")
    model = LlamaModel.load(path, ModelOptions(extra_buffers=False))
    print("| flash | KV | cells | alone = again | = beside 1 | = beside 2 | max diff |")
    print("|---|---|---|---|---|---|---|")
    try:
        for flash in args.flash:
            for layout in args.layout:
                for cells in args.context:
                    print(compare(model, flash, layout == "split", cells), flush=True)
    finally:
        model.free()


if __name__ == "__main__":
    main()
