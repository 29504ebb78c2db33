"""Prompt-lookup speculative decoding on and off, side by side in one run, on
Qwen2.5-Coder-0.5B in this process (the engine alone, greedy).

    .venv/bin/python -m bench.speculate [--rounds 3] [--tokens 256] [--draft-max 8]

Workloads: a code edit (the answer repeats most of a given file with one change) and a
free answer (little to copy). Rounds alternate (off, on, off, ...) after one warm-up
each; the medians of generated tokens/s are compared, with the acceptance rate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import EngineRequest, SamplingParams
from barrel.metrics import Metrics
from barrel.store import bundled
from bench.http import prompt_of

FILE = "\n\n".join(
    f'''def shape_{i}(width, height):
    """Area and perimeter of rectangle number {i}."""
    area = width * height
    perimeter = 2 * (width + height)
    return area, perimeter'''
    for i in range(8)
)
WORKLOADS = {
    "code edit": "Rename the parameter width to w everywhere in this file and print the "
    f"whole file:\n\n```python\n{FILE}\n```",
    "free answer": "Explain in a few paragraphs how a hash map handles collisions.",
}


async def one_round(engine: Engine, prompt: list[int], tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    request = EngineRequest(prompt, max_tokens=tokens, sampling=SamplingParams(temperature=0))
    _, done = await engine.submit(request).collect()
    return done.usage.completion_tokens, time.perf_counter() - start - done.timings.prefill_s


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--draft-max", type=int, default=EngineOptions.draft_max)
    parser.add_argument("--ngram", type=int, default=EngineOptions.draft_ngram)
    args = parser.parse_args()
    model = LlamaModel.load(bundled.assemble("qwen2.5-coder-0.5b"))
    metrics = {mode: Metrics() for mode in ("off", "ngram")}
    engines = {
        mode: Engine(
            model,
            EngineOptions(
                n_ctx=4096,
                n_seq_max=1,
                speculation=mode,
                draft_max=args.draft_max,
                draft_ngram=args.ngram,
                state_cache_bytes=0,
            ),
            observer=metrics[mode].engine_observer(mode),
        ).start()
        for mode in ("off", "ngram")
    }
    try:
        m = metrics["ngram"].registry

        def counted(name: str) -> float:
            return m.get_sample_value(name, {"model": "ngram"}) or 0.0

        for name, text in WORKLOADS.items():
            tried0 = counted("barrel_engine_draft_tokens_total")
            kept0 = counted("barrel_engine_draft_accepted_tokens_total")
            prompt = prompt_of(model, [{"role": "user", "content": text}])  # as HTTP renders
            rates: dict[str, list[float]] = {"off": [], "ngram": []}
            for r in range(args.rounds + 1):
                for mode, engine in engines.items():
                    n, seconds = await one_round(engine, prompt, args.tokens)
                    if r > 0:  # the first round warms up
                        rates[mode].append(n / seconds)
            off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
            tried = counted("barrel_engine_draft_tokens_total") - tried0
            kept = counted("barrel_engine_draft_accepted_tokens_total") - kept0
            share = kept / tried if tried else 0.0
            print(
                f"{name}: off {off:.1f} tok/s, on {on:.1f} tok/s, ratio {on / off:.2f}x "
                f"({tried:.0f} draft tokens, {share:.0%} kept)"
            )
    finally:
        for engine in engines.values():
            engine.stop()
        model.free()


if __name__ == "__main__":
    asyncio.run(main())
