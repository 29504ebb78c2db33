"""The next turn of a long conversation after its model unloaded, and after a restart:
persistence on against off, side by side in one run, on Qwen2.5-Coder-0.5B Q4_K_M.

    .venv/bin/python -m bench.persist [--rounds 2] [--tokens 4000]

Two daemons, alike but for `[models] kv_states_bytes` (the default against 0). Each
round, for each daemon (who goes first alternating): a first turn of a ~`tokens`-token
document and a question (its answer not timed), then

- unload: `keep_alive: 0`, and the second turn's time to first token (the load included);
- restart: SIGTERM, a fresh `barrel serve` over the same cache, and the second turn's
  time to first token (the load included);

every round a document neither daemon has seen. The line is the ratio of the medians,
persistence on over off (the acceptance: at most 0.1x).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import tempfile
from pathlib import Path

import aiohttp

from barrel.store import bundled
from bench.http import start_daemon, wait_ready
from bench.peers import document, first_token

SIDES = {"on": "", "off": "kv_states_bytes = 0"}


class Side:
    def __init__(self, tmp: Path, path: Path, n: int, models: str, ctx: int) -> None:
        self.tmp, self.path, self.n, self.models, self.ctx = tmp, path, n, models, ctx
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.proc, self.url = start_daemon(
            self.tmp, self.path, 2, n=self.n, ctx=self.ctx, models=self.models
        )
        await wait_ready(session, self.url, timeout=120)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(300)
            self.proc = None


async def _turns(
    session: aiohttp.ClientSession, side: Side, seed: int, tokens: int
) -> list[dict[str, str]]:
    """The first turn, asked and answered: the second turn's messages."""
    ask = [{"role": "user", "content": f"{document(tokens, seed)}\nWho got the most?"}]
    async with session.post(
        side.url + "/v1/chat/completions",
        json={"model": "qwen", "messages": ask, "max_tokens": 16, "temperature": 0},
    ) as resp:
        answer = (await resp.json())["choices"][0]["message"]["content"]
    return [*ask, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]


async def _next_turn(
    session: aiohttp.ClientSession, side: Side, msgs: list[dict[str, str]]
) -> float:
    ttft, _, _ = await first_token(session, side.url, {"messages": msgs, "max_tokens": 4})
    return ttft


async def measure(args: argparse.Namespace) -> None:
    path = bundled.assemble("qwen2.5-coder-0.5b")
    timeout = aiohttp.ClientTimeout(total=1800)
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sides = {
            name: Side(Path(tmp), path, n, models, args.tokens + 512)
            for n, (name, models) in enumerate(SIDES.items())
        }
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                for side in sides.values():
                    await side.start(session)
                for r in range(args.rounds):
                    order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                    for name in order:
                        side = sides[name]
                        msgs = await _turns(session, side, 1000 + 2 * r, args.tokens)
                        async with session.post(
                            side.url + "/api/generate", json={"model": "qwen", "keep_alive": 0}
                        ) as resp:
                            assert (await resp.json())["done_reason"] == "unload"
                        ttft = await _next_turn(session, side, msgs)
                        results.setdefault((name, "unload"), []).append(ttft)
                        print(f"round {r + 1} {name:>3} unload : {ttft:6.2f} s", flush=True)
                    for name in order:
                        side = sides[name]
                        msgs = await _turns(session, side, 1001 + 2 * r, args.tokens)
                        side.stop()
                        await side.start(session)
                        ttft = await _next_turn(session, side, msgs)
                        results.setdefault((name, "restart"), []).append(ttft)
                        print(f"round {r + 1} {name:>3} restart: {ttft:6.2f} s", flush=True)
            finally:
                for side in sides.values():
                    side.stop()
    for scenario in ("unload", "restart"):
        on = statistics.median(results[("on", scenario)])
        off = statistics.median(results[("off", scenario)])
        print(
            f"next turn after {scenario:>7}: persistence on {on:6.2f} s  off {off:6.2f} s"
            f"  ratio {on / off:.3f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4000, help="the conversation's length")
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
