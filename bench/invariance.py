"""How often a greedy answer changes with how its tokens were batched, by KV layout and
flash-attention setting, on Qwen2.5-Coder-0.5B through the engine.

    .venv/bin/python -m bench.invariance [--variants unified:auto,split:on,split:off]
        [--lengths short,180,2200] [--prompts 16] [--tokens 48]

For each variant (a KV layout, `unified` or `split` as `EngineOptions.kv_per_sequence`,
and a flash-attention setting) and each prompt length, every prompt is answered
greedily three times:

- by an engine without drafts, then again by the same engine: the second answer reuses
  the first's cached prompt and decodes only its last token, where the first decoded
  the whole prompt in one step ("repeat");
- by an engine with prompt-lookup drafts, where steps verify several tokens at once
  ("drafts").

It counts the prompts whose repeat, or whose drafted answer, differs from the first
answer. Nothing here is timed. llama.cpp's CPU kernels round differently by the number
of rows a step has (see bench/NOTEBOOK.md, "Batch invariance"), so a count above
zero means near ties flipped, not a bug in the engine.
"""

from __future__ import annotations

import argparse
import asyncio

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import EngineRequest
from barrel.store import bundled

SHORT = [
    "def fib(n):",
    "The capital of France is",
    "import numpy as",
    "class Stack:",
    "SELECT name FROM",
    "fn main() {",
    "# Sort a list",
    "def is_prime(n):",
    "Once upon a time",
    "const add = (a, b) =>",
    "for i in range(",
    "public static void",
    "The quick brown fox",
    "def merge(a, b):",
    "#include <stdio.h>",
    "async def fetch(",
]
# ledger facts per prompt length (Qwen tokens of the whole chat prompt)
FACTS = {"180": 10, "2200": 120}


def prompts(model: LlamaModel, length: str, n: int) -> list[list[int]]:
    if length == "short":
        return [model.tokenize(text) for text in (SHORT * (n // len(SHORT) + 1))[:n]]
    out = []
    for k in range(n):
        notes = " ".join(
            f"Fact {k}.{i}: item {i} costs {i * 3 + k} coins." for i in range(FACTS[length])
        )
        chat = (
            f"<|im_start|>system\nYou keep a ledger. {notes}<|im_end|>\n"
            "<|im_start|>user\nList items 5 to 9 with their costs.<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        out.append(model.tokenize(chat, add_special=False))
    return out


async def answers(
    model: LlamaModel, opts: EngineOptions, asks: list[list[int]], tokens: int, twice: bool
) -> list[list[tuple[int, ...]]]:
    engine = Engine(model, opts).start()
    out = []
    try:
        for prompt in asks:
            runs = []
            for _ in range(2 if twice else 1):
                req = EngineRequest(prompt, max_tokens=tokens)
                _, done = await engine.submit(req).collect()
                runs.append(tuple(done.tokens))
            out.append(runs)
    finally:
        engine.stop()
    return out


async def measure(args: argparse.Namespace) -> None:
    model = LlamaModel.load(bundled.assemble("qwen2.5-coder-0.5b"))
    rows = []
    for variant in args.variants.split(","):
        layout, flash = variant.split(":")
        cells = []
        for length in args.lengths.split(","):
            asks = prompts(model, length, args.prompts)
            base = dict(n_ctx=4096, kv_per_sequence=layout == "split", flash_attn=flash)
            plain = await answers(
                model, EngineOptions(speculation="off", **base), asks, args.tokens, True
            )
            drafted = await answers(
                model, EngineOptions(speculation="ngram", **base), asks, args.tokens, False
            )
            repeat = sum(p[0] != p[1] for p in plain)
            drafts = sum(p[0] != d[0] for p, d in zip(plain, drafted, strict=True))
            cells.append(f"{repeat} / {drafts}")
            print(f"{variant} {length}: repeat {repeat}, drafts {drafts}", flush=True)
        rows.append(f"| {layout}, flash {flash} | " + " | ".join(cells) + " |")
    lengths = args.lengths.split(",")
    print(f"\nanswers that differ (repeat / drafts) of {args.prompts} prompts:")
    print("| variant | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    print("\n".join(rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="unified:auto,split:on,split:off")
    p.add_argument("--lengths", default="short,180,2200")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    asyncio.run(measure(p.parse_args()))


if __name__ == "__main__":
    main()
