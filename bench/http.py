"""The HTTP path against the engine alone, side by side in one run, on Qwen2.5-Coder-0.5B.

    .venv/bin/python -m bench.http [--clients 4] [--tokens 128] [--rounds 3]

`clients` concurrent streaming chat requests, greedy, the same prompts and sessions on
both sides:
- engine alone: the engine in this process, fed the prompts the chat pipeline renders;
- HTTP: `barrel serve` as a subprocess, the same chat through POST /v1/chat/completions
  with stream=true, read by aiohttp clients in this process.
Throughput rounds alternate (engine, HTTP, engine, ...) after one warm-up each, and
their medians are compared. Time to first token is measured apart, in short rounds (one
token each, alternating): the HTTP round's median minus the engine round's, median
over the pairs, so that the drift of this noisy box between rounds cancels out.
Targets: the HTTP path keeps >= 0.95 of the engine's aggregate tokens/s and adds < 10 ms
(p50) to the time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import Delta, Done, EngineRequest, SamplingParams, SessionId
from barrel.pipeline.chat import ChatRequest
from barrel.pipeline.families import detect_family
from barrel.pipeline.prompt import prepare
from barrel.pipeline.request import Dialect
from barrel.pipeline.sampling import effective, sampling_params
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import make_template
from barrel.store import bundled

MODEL = "qwen"
CTX = 4096


def messages(i: int) -> list[dict[str, str]]:
    ask = f"Client {i}: write the numbers from 1 to 200 in words, one per line."
    return [{"role": "user", "content": ask}]


def prompt_of(model: LlamaModel, msgs: list[dict[str, str]]) -> list[int]:
    """The prompt the daemon renders for these messages (a local file has no SYSTEM)."""
    bos = model.piece(model.bos, special=True).decode() if model.bos >= 0 else ""
    eos = model.piece(model.eos, special=True).decode() if model.eos >= 0 else ""
    template = make_template(model.meta("tokenizer.chat_template") or "", bos, eos)
    prep = prepare(ChatRequest(msgs), template, model.tokenize, detect_family(template.source))
    return prep.prompt


# -- the engine alone ---------------------------------------------------------------------


async def engine_request(
    engine: Engine, prompt: list[int], session: SessionId, sampling: SamplingParams, n: int
) -> tuple[float, int, float]:
    """(time to first token, completion tokens, end time)."""
    start = time.perf_counter()
    first = 0.0
    req = EngineRequest(prompt, sampling, max_tokens=n, session=session)
    async with engine.submit(req) as stream:
        async for event in stream:
            if isinstance(event, Delta) and event.text and not first:
                first = time.perf_counter() - start
            elif isinstance(event, Done):
                return first, event.usage.completion_tokens, time.perf_counter()
    raise RuntimeError("no Done")


async def engine_round(
    engine: Engine, model: LlamaModel, clients: int, n: int
) -> tuple[float, list[float]]:
    # what the HTTP side samples with: OpenAI's defaults under the request's temperature
    sampling = sampling_params(effective(Dialect.OPENAI, {"temperature": 0}, {}, {}))[0]
    jobs = []
    for i in range(clients):
        msgs = messages(i)
        session = derive_session(MODEL, msgs)
        jobs.append(engine_request(engine, prompt_of(model, msgs), session, sampling, n))
    start = time.perf_counter()
    results = await asyncio.gather(*jobs)
    elapsed = max(end for _, _, end in results) - start
    return sum(t for _, t, _ in results) / elapsed, [f for f, _, _ in results]


# -- the HTTP path ----------------------------------------------------------------------------


async def http_request(
    session: aiohttp.ClientSession, url: str, i: int, n: int
) -> tuple[float, int, float]:
    body = {
        "model": MODEL,
        "messages": messages(i),
        "temperature": 0,
        "max_tokens": n,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode()
            if not first and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - start
            elif line.startswith('data: {"id"') and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return first, tokens, time.perf_counter()


async def http_round(
    session: aiohttp.ClientSession, url: str, clients: int, n: int
) -> tuple[float, list[float]]:
    start = time.perf_counter()
    results = await asyncio.gather(*(http_request(session, url, i, n) for i in range(clients)))
    elapsed = max(end for _, _, end in results) - start
    return sum(t for _, t, _ in results) / elapsed, [f for f, _, _ in results]


def start_daemon(
    tmp: Path,
    path: Path,
    clients: int,
    defaults: str = "",
    n: int = 0,
    env: dict[str, str] | None = None,
    ctx: int = CTX,
    models: str = "",
) -> tuple[subprocess.Popen[bytes], str]:
    """The `n`th Barrel daemon of a bench (its own port and config), with `defaults`
    added to its `[models.defaults]` and `models` to its `[models]` (TOML lines), and
    `env` added to its environment."""
    port = 18000 + (os.getpid() + 7 * n) % 1000
    config = tmp / f"bench{n}.toml"
    config.write_text(
        f'[server]\naccess_log = false\n[models]\ncache_root = "{tmp / f"store{n}"}"\n'
        f"max_context_size = {ctx}\n{models}\n"
        f"[models.defaults]\nnum_seq_max = {clients}\n{defaults}\n"
    )
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "barrel", "serve", "--port", str(port)),
            *("--config", str(config), "--model", f"{MODEL}={path}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(
    session: aiohttp.ClientSession, url: str, path: str = "/health/ready", timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url + path) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-rounds", type=int, default=20)
    args = parser.parse_args()
    path = bundled.assemble("qwen2.5-coder-0.5b")
    model = LlamaModel.load(path)
    opts = EngineOptions(n_ctx=CTX, n_seq_max=args.clients)
    engine = Engine(model, opts, name="bench").start()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_daemon(Path(tmp), path, args.clients)
        timeout = aiohttp.ClientTimeout(total=600)
        connector = aiohttp.TCPConnector(limit=args.clients * 2)
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                await wait_ready(session, url)
                await engine_round(engine, model, args.clients, args.tokens)  # warm-up
                await http_round(session, url, args.clients, args.tokens)  # loads the model
                rates: dict[str, list[float]] = {"engine": [], "http": []}
                for _ in range(args.rounds):
                    rates["engine"].append(
                        (await engine_round(engine, model, args.clients, args.tokens))[0]
                    )
                    rates["http"].append(
                        (await http_round(session, url, args.clients, args.tokens))[0]
                    )
                # time to first token: short rounds (one token), alternating, paired
                firsts: dict[str, list[float]] = {"engine": [], "http": []}
                added: list[float] = []
                for _ in range(args.ttft_rounds):
                    _, e_first = await engine_round(engine, model, args.clients, 1)
                    _, h_first = await http_round(session, url, args.clients, 1)
                    firsts["engine"] += e_first
                    firsts["http"] += h_first
                    added.append(statistics.median(h_first) - statistics.median(e_first))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            engine.stop()
            model.free()
    e, h = statistics.median(rates["engine"]), statistics.median(rates["http"])
    fe, fh = statistics.median(firsts["engine"]), statistics.median(firsts["http"])
    print(
        f"{args.clients} streaming clients, {args.tokens} tokens each, {args.rounds} rounds: "
        f"aggregate engine {e:.1f} tok/s, HTTP {h:.1f} tok/s, ratio {h / e:.3f} (>= 0.95)"
    )
    print(
        f"time to first token p50 over {args.ttft_rounds} paired rounds: engine "
        f"{fe * 1000:.1f} ms, HTTP {fh * 1000:.1f} ms, added {statistics.median(added) * 1000:.1f}"
        " ms (< 10 ms)"
    )


if __name__ == "__main__":
    asyncio.run(main())
