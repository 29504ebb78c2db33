"""Engine benchmarks on Qwen2.5-Coder-0.5B, side by side in one run.

    .venv/bin/python -m bench.engine [--tokens 128] [--rounds 3]

1. One stream: a bare low-level llama.cpp decode loop against the engine (greedy, the
   same prompt, EOS ignored), interleaved, median of `rounds`. Target: engine >= 0.95.
2. Aggregate tokens/s at 1, 2, 4 and 8 concurrent streams. Target: 4 streams >= 1.8x one.
3. Time to first token of turn 3 of a ~1,500-token conversation, warm (same session,
   KV reused) against the same prompt cold. Target: warm <= 25% of cold.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import llama_cpp as ll

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, EngineRequest, SessionId
from barrel.store import bundled

PROMPT = (
    "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def bare_loop_in_thread(model: LlamaModel, prompt: list[int], n_tokens: int) -> float:
    """Run `bare_loop` on a thread that ends afterwards, as the engine's does.

    llama.cpp's CPU backend uses OpenMP, and libgomp keeps one thread team per calling
    thread for the thread's lifetime. With more managed threads than cores it throttles
    its spin-wait, and decode slows by about a third; so neither side of the comparison
    may leave a team behind (see guides/performance.md)."""
    result: list[float] = []
    t = threading.Thread(target=lambda: result.append(bare_loop(model, prompt, n_tokens)))
    t.start()
    t.join()
    return result[0]


def bare_loop(model: LlamaModel, prompt: list[int], n_tokens: int) -> float:
    """Tokens/s of a plain llama_decode loop: one sequence, greedy."""
    params = ll.llama_context_default_params()
    params.n_ctx = 2048
    params.n_batch = 512
    params.n_seq_max = 1
    threads = os.cpu_count() or 1
    params.n_threads = threads
    params.n_threads_batch = threads
    params.no_perf = True
    ctx = ll.llama_init_from_model(model.handle, params)
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_greedy())
    batch = ll.llama_batch_init(512, 0, 1)
    try:

        def decode(tokens: list[int], start: int) -> None:
            for i, t in enumerate(tokens):
                batch.token[i] = t
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            if ll.llama_decode(ctx, batch) != 0:
                raise RuntimeError("decode failed")

        decode(prompt, 0)
        token = ll.llama_sampler_sample(sampler, ctx, -1)
        pos = len(prompt)
        start = time.perf_counter()
        for _ in range(n_tokens - 1):
            decode([token], pos)
            pos += 1
            token = ll.llama_sampler_sample(sampler, ctx, -1)
        return (n_tokens - 1) / (time.perf_counter() - start)
    finally:
        ll.llama_batch_free(batch)
        ll.llama_sampler_free(sampler)
        ll.llama_free(ctx)


async def engine_stream(engine: Engine, prompt: list[int], n_tokens: int) -> float:
    req = EngineRequest(prompt, GREEDY, max_tokens=n_tokens, ignore_eos=True)
    _, done = await engine.submit(req).collect()
    return (done.usage.completion_tokens - 1) / done.timings.decode_s


async def aggregate(engine: Engine, model: LlamaModel, streams: int, n_tokens: int) -> float:
    prompts = [
        model.tokenize(PROMPT.replace("lighthouse keeper", f"sailor number {i}"))
        for i in range(streams)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            engine.submit(EngineRequest(p, GREEDY, max_tokens=n_tokens, ignore_eos=True)).collect()
            for p in prompts
        )
    )
    elapsed = time.perf_counter() - start
    return sum(done.usage.completion_tokens for _, done in results) / elapsed


def conversation(model: LlamaModel) -> tuple[list[str], list[str]]:
    """User turns of a code-review conversation (~1,500 tokens by turn 3)."""
    code = "\n".join(
        f"def handler_{i}(request, db):\n    row = db.get(request.id + {i})\n"
        f"    if row is None:\n        return {{'status': 404}}\n"
        f"    return {{'status': 200, 'row': row}}\n"
        for i in range(24)
    )
    users = [
        f"Review this module and list its problems:\n```python\n{code}\n```",
        "Rewrite handler_3 with type hints and error handling.",
        "Now write a pytest test for it.",
    ]
    return users, []


def render(turns: list[tuple[str, str]]) -> str:
    text = "<|im_start|>system\nYou are a senior Python reviewer.<|im_end|>\n"
    for role, content in turns:
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


async def ttft_turn3(model: LlamaModel, opts: EngineOptions) -> tuple[float, float, int, int]:
    users, _ = conversation(model)
    engine = Engine(model, opts, name="warm").start()
    turns: list[tuple[str, str]] = []
    session = SessionId("review")
    try:
        for i, user in enumerate(users):
            turns.append(("user", user))
            prompt = model.tokenize(render(turns))
            deltas, done = await engine.submit(
                EngineRequest(prompt, GREEDY, max_tokens=48, session=session)
            ).collect()
            turns.append(("assistant", "".join(d.text for d in deltas)))
            if i == 2:
                warm, reused, total = (
                    done.timings.time_to_first_token_s,
                    done.usage.prompt_reused,
                    len(prompt),
                )
    finally:
        engine.stop()
    cold_engine = Engine(model, opts, name="cold").start()
    try:
        _, done = await cold_engine.submit(EngineRequest(prompt, GREEDY, max_tokens=1)).collect()
        cold = done.timings.time_to_first_token_s
    finally:
        cold_engine.stop()
    return warm, cold, reused, total


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = LlamaModel.load(bundled.assemble("qwen2.5-coder-0.5b"))
    prompt = model.tokenize(PROMPT)

    opts1 = EngineOptions(n_ctx=2048, n_seq_max=1, state_cache_bytes=0)
    bare, eng = [], []
    for _ in range(args.rounds):
        bare.append(bare_loop_in_thread(model, prompt, args.tokens))
        e = Engine(model, opts1).start()
        try:
            eng.append(await engine_stream(e, prompt, args.tokens))
        finally:
            e.stop()
    b, m = statistics.median(bare), statistics.median(eng)
    print(f"one stream: bare loop {b:.1f} tok/s, engine {m:.1f} tok/s, ratio {m / b:.3f}")

    e = Engine(model, EngineOptions(n_ctx=4096, n_seq_max=8, state_cache_bytes=0)).start()
    try:
        rates = {}
        for n in (1, 2, 4, 8):
            rates[n] = await aggregate(e, model, n, 64)
        line = ", ".join(f"{n}: {r:.1f}" for n, r in rates.items())
        print(f"aggregate tok/s by streams: {line}; 4 vs 1: {rates[4] / rates[1]:.2f}x")
    finally:
        e.stop()

    warm, cold, reused, total = await ttft_turn3(model, EngineOptions(n_ctx=4096, n_seq_max=4))
    print(
        f"turn 3 ({total} prompt tokens, {reused} reused): time to first token "
        f"warm {warm * 1000:.0f} ms, cold {cold * 1000:.0f} ms, ratio {warm / cold:.3f}"
    )
    model.free()


if __name__ == "__main__":
    asyncio.run(main())
