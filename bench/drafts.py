"""Prompt-lookup drafting replayed on recorded greedy answers: what `NgramDrafter` would
save on each of a set of requests, without running the engine again for every policy.

    .venv/bin/python -m bench.drafts [--tokens 256] [--ngram 12] [--draft-max 64] [--reps 3]
        [--policy module:Class]

Each workload's greedy answer is generated once by the engine with speculation off
(drafts never change a greedy answer: tests/test_speculation.py). Raw `llama_decode`
steps with logits on every row, as a verified draft has, are timed at the sizes a step
with a draft can have (bench.steps, the engine's KV layout and attention on this CPU).
`replay` then walks each answer the way the engine plans one sequence's steps: a draft
within the room left, trimmed by `align_drafts`, kept while it equals the answer,
`record`ed. The estimate is the sum of those steps' costs against one-token steps for
every token; the first token (from the prefill) counts in neither.

A policy under test is a class with NgramDrafter's constructor and methods, named by
`--policy` (importable from PYTHONPATH) and replayed beside NgramDrafter; `--ngram` and
`--draft-max` set the engine's two knobs. tests/test_speculation.py checks that the
replay drafts exactly as the engine does.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import importlib
import statistics
from collections.abc import Callable

import llama_cpp as ll

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.speculate import ALIGN, NgramDrafter, align_drafts
from barrel.engine.types import EngineRequest, SamplingParams
from barrel.store import bundled
from bench.http import prompt_of
from bench.peers import CODE_EDIT
from bench.steps import Variant

LEDGER = " ".join(f"Fact 1.{k}: item {k} costs {k * 3} coins." for k in range(120))
BRIDGE = (
    "The Hale Bridge opened in 1911. It spans 340 metres across the Ord river and carries "
    "two rail tracks. In 1952 a road deck was added above the tracks. The bridge was "
    "painted green in 1978 and grey in 2004."
)
MEAN = """def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0
    return total / count"""
# Requests of different kinds: some copy their prompt, most do not
WORKLOADS = {
    "code edit": CODE_EDIT,
    "refactor": f"Add type hints to this function and return the whole function:\n\n{MEAN}",
    "ledger": f"You keep a ledger. {LEDGER}\n\nWhat does item 14 cost?",
    "quote": f"{BRIDGE}\n\nWhat happened to the bridge in 1952? Quote the text.",
    "prose": "Explain how a hash map works.",
    "tool call": "Write a JSON object for a call of get_weather with city=Paris, "
    "unit=celsius, days=3, and a second one for Berlin with the same unit and days.",
    "sql": "Write a SQL query joining users and orders on user_id, returning each user's "
    "name and total order amount, sorted by amount.",
    "list": "Count from one to forty in words, one per line, numbered like '1. One'.",
    "numbers": "Client 0: write the numbers 1 to 200 in words.",  # bench/peers' streams
}


def replay(
    prompt: list[int],
    answer: list[int],
    drafter: NgramDrafter,
    max_tokens: int | None = None,
    n_ctx: int = 4096,
    capacity: int = 512,
) -> list[tuple[int, int]]:
    """(draft tokens, kept) of every step after the prefill that generated `answer`
    greedily, drafting as `Verifier.draft` and `Verifier.verify` do for a sequence alone
    in its step. `drafter` holds the prompt (NgramDrafter(prompt, n, k))."""
    generated = answer[:1]  # the prefill's token: pending, not yet decoded
    steps: list[tuple[int, int]] = []
    while len(generated) < len(answer):
        drafter.extend(generated[len(drafter.history) - len(prompt) :])
        room = min(capacity - 1, n_ctx - (len(prompt) + len(generated) - 1) - 2)
        if max_tokens is not None:
            room = min(room, max_tokens - len(generated) - 1)
        draft = drafter.draft(room)
        align_drafts([draft], 1 + len(draft))
        at, last = len(generated), len(answer) - 1
        kept = 0  # the last token ends the run when sampled: no draft token is kept there
        while kept < len(draft) and at + kept < last and draft[kept] == answer[at + kept]:
            kept += 1
        if draft:
            drafter.record(len(draft), kept)
        generated += answer[at : at + kept + 1]
        steps.append((len(draft), kept))
    return steps


def cost_of(costs: dict[int, float]) -> Callable[[int], float]:
    """A step's cost by its rows, linear between the sizes timed."""
    sizes = sorted(costs)

    def cost(n: int) -> float:
        if n in costs:
            return costs[n]
        i = min(max(bisect.bisect(sizes, n), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)

    return cost


def step_costs(model: LlamaModel, context: int, largest: int, reps: int) -> dict[int, float]:
    """Median ms of a step of n rows, every row with logits, after `context` cells."""
    args = argparse.Namespace(streams=[], extra=["off"], models=[], context=context, parked=0)
    variant = Variant(model, "auto", "f16", "split", args)
    sizes = [1, *range(ALIGN, largest + 1, ALIGN)]
    try:
        for _ in range(reps):
            for n in sizes:
                variant.step(n, context, last_only=False)
    finally:
        variant.batch.free()
        ll.llama_free(variant.ctx)
    return {n: statistics.median(variant.times[str(n)]) for n in sizes}


async def answers(
    model: LlamaModel, prompts: dict[str, list[int]], tokens: int
) -> dict[str, list[int]]:
    engine = Engine(
        model, EngineOptions(n_ctx=4096, n_seq_max=1, speculation="off", state_cache_bytes=0)
    ).start()
    try:
        out = {}
        for name, prompt in prompts.items():
            request = EngineRequest(
                prompt, max_tokens=tokens, sampling=SamplingParams(temperature=0)
            )
            _, done = await engine.submit(request).collect()
            out[name] = list(done.tokens)
        return out
    finally:
        await asyncio.to_thread(engine.stop)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--ngram", type=int, default=EngineOptions.draft_ngram)
    parser.add_argument("--draft-max", type=int, default=EngineOptions.draft_max)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--policy", default="")
    args = parser.parse_args()
    policies: dict[str, type[NgramDrafter]] = {"NgramDrafter": NgramDrafter}
    if args.policy:
        module, _, name = args.policy.partition(":")
        policies[name] = getattr(importlib.import_module(module), name)
    model = LlamaModel.load(bundled.assemble("qwen2.5-coder-0.5b"))
    try:
        prompts = {
            name: prompt_of(model, [{"role": "user", "content": text}])
            for name, text in WORKLOADS.items()
        }
        replies = asyncio.run(answers(model, prompts, args.tokens))
        context = int(statistics.median(len(p) for p in prompts.values()))
        largest = args.draft_max + ALIGN - args.draft_max % ALIGN
        cost = cost_of(step_costs(model, context, largest, args.reps))
    finally:
        model.free()
    print(f"n-gram {args.ngram}, drafts up to {args.draft_max}, steps timed at {context} cells")
    for label, policy in policies.items():
        print(f"\n{label}:\n")
        print("| workload | tokens | steps | drafted | kept | est. tok/s with / without |")
        print("|---|---|---|---|---|---|")
        total = plain = 0.0
        for name, prompt in prompts.items():
            answer = replies[name]
            drafter = policy(list(prompt), args.ngram, args.draft_max)
            steps = replay(prompt, answer, drafter, args.tokens)
            ms = sum(cost(1 + d) for d, _ in steps)
            alone = cost(1) * (len(answer) - 1)
            total, plain = total + ms, plain + alone
            drafted, kept = sum(d for d, _ in steps), sum(k for _, k in steps)
            print(
                f"| {name} | {len(answer)} | {len(steps)} | {drafted} | {kept} "
                f"| {alone / ms if ms else 1.0:.2f}x |"
            )
        print(f"| all | | | | | {plain / total if total else 1.0:.2f}x |")


if __name__ == "__main__":
    main()
