"""Structured output against free decoding and against llama-server, side by side in one
run, through HTTP, on Qwen2.5-Coder-0.5B Q4_K_M (one stream, greedy).

    .venv/bin/python -m bench.structured [--rounds 3] [--tokens 256]

Three request shapes, each asked free (the same messages, no constraint) and
constrained: a small schema (`response_format` json_schema, six fields), a nested schema
(arrays of objects, enums, a nested object), and a forced tool call (`tool_choice`
naming the tool, whose parameters are the nested schema). Decode tokens/s is a stream's
tokens after the first over the time from its first token to its last (prefill is left
out: both sides prefill the same prompt). Rounds alternate who goes first; every
measurement starts once both servers are idle (bench.peers.settle).

Printed per shape: Barrel constrained over Barrel free (the line asks >= 0.95x) and
Barrel constrained over llama-server constrained (>= 1.3x), paired per round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from barrel.store import bundled
from bench.http import start_daemon, wait_ready
from bench.peers import PARALLEL, compare, llama_server, settle, start_llama_server, stream

SMALL = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "city", "active", "score"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "tier": {"enum": ["free", "pro"]}},
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 2,
            "maxItems": 4,
        },
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}
ASK_PERSON = "Invent a person and describe them as JSON with {keys}."
ASK_ORDER = "Invent an online shop order with its customer and three items, as JSON with {keys}."


def _ask(template: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": template.format(keys=", ".join(schema["properties"]))}]


def shapes() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """name -> (free body, constrained body)."""
    small = {"messages": _ask(ASK_PERSON, SMALL)}
    nested = {"messages": _ask(ASK_ORDER, NESTED)}
    tool = {
        "type": "function",
        "function": {
            "name": "record_order",
            "description": "Record an order",
            "parameters": NESTED,
        },
    }

    def schema(s: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": s, "strict": True},
        }

    return {
        "small schema": (small, {**small, "response_format": schema(SMALL)}),
        "nested schema": (nested, {**nested, "response_format": schema(NESTED)}),
        "forced tool call": (
            nested,
            {
                **nested,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "record_order"}},
            },
        ),
    }


async def decode_rate(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], tokens: int
) -> tuple[float, int, str]:
    """(decode tokens/s, tokens, text) of one streamed greedy request: content and
    tool-call argument pieces both count as output."""
    extra = {k: v for k, v in body.items() if k != "messages"}
    start = time.perf_counter()
    first, used, end, text = await stream(session, url, body["messages"], tokens, extra=extra)
    if used < 2 or not first:
        return 0.0, used, text
    return (used - 1) / (end - start - first), used, text


def valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def one_round(
    session: aiohttp.ClientSession,
    order: list[tuple[str, str]],
    pids: list[int],
    plan: dict[str, tuple[dict[str, Any], dict[str, Any]]],
    tokens: int,
    results: dict[str, dict[str, list[float]]],
) -> None:
    """Every shape, free then constrained, on each server in `order`."""
    for shape, (free, constrained) in plan.items():
        for kind, body in (("free", free), ("constrained", constrained)):
            for name, url in order:
                await settle(pids)
                rate, used, text = await decode_rate(session, url, body, tokens)
                if kind == "constrained" and not valid(text):
                    print(f"  {name} {shape}: not JSON after {used} tokens: {text[:80]!r}")
                key = f"{shape} {kind}"
                results.setdefault(name, {}).setdefault(key, []).append(rate)
                results[name].setdefault(key + " tokens", []).append(used)


async def measure(args: argparse.Namespace) -> None:
    model = bundled.assemble("qwen2.5-coder-0.5b")
    llama_server()
    timeout = aiohttp.ClientTimeout(total=900)
    plan = shapes()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "barrel": start_daemon(Path(tmp), model, PARALLEL),
            "llama-server": start_llama_server(model),
        }
        try:
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                for name, (_, url) in servers.items():
                    await wait_ready(
                        session,
                        url,
                        "/health/ready" if name == "barrel" else "/health",
                        timeout=120,
                    )
                    for free, constrained in plan.values():  # warm-up: load, compile
                        await decode_rate(session, url, free, 16)
                        await decode_rate(session, url, constrained, 16)
                pids = [proc.pid for proc, _ in servers.values()]
                urls = [(name, url) for name, (_, url) in servers.items()]
                for r in range(args.rounds):
                    order = urls if r % 2 == 0 else urls[::-1]
                    await one_round(session, order, pids, plan, args.tokens, results)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    ours, theirs = results["barrel"], results["llama-server"]
    for shape in plan:
        free, constrained = f"{shape} free", f"{shape} constrained"
        print(
            f"{shape}: tokens barrel {statistics.median(ours[constrained + ' tokens']):.0f}"
            f" / free {statistics.median(ours[free + ' tokens']):.0f},"
            f" llama-server {statistics.median(theirs[constrained + ' tokens']):.0f}"
            f" / free {statistics.median(theirs[free + ' tokens']):.0f}"
        )
        compare("vs free (barrel)", ours[constrained], ours[free])
        compare("vs llama-server", ours[constrained], theirs[constrained])
        compare("llama-server vs free", theirs[constrained], theirs[free])
        compare("free vs llama-server", ours[free], theirs[free])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
