"""Barrel against llama.cpp's own llama-server, side by side in one run, through HTTP
with the same client, on Qwen2.5-Coder-0.5B Q4_K_M.

    .venv/bin/python -m bench.peers [--rounds 3] [--tokens 128] [--workloads follow-up,...]

llama-server is built once from the llama.cpp vendored in the pinned llama-cpp-python
sdist (cmake and a C++ compiler needed; cached under the models cache). It is a
measuring stick, never a dependency. Both servers get the same model file, a 4096-token
context and 8 parallel sequences; requests are greedy and streamed. After a warm-up
each, every round runs one workload at a time on all servers (seconds apart, so that
the drift of a noisy box falls on both sides alike), who goes first alternating between
rounds, and each measurement starts once every server has been idle for half a second
(`settle`); medians are compared, and so are the rounds one by one (the median of each
round's ratio), with the rounds' values beside them:

- aggregate tokens/s at 1, 4 and 8 concurrent streams;
- the time to first token of a follow-up turn in a ~1,500-token conversation, asked at
  once and asked 1 s after the answer (a person reading it);
- the time to first token of a ~1,900-token prompt neither server has seen (cold);
- a code edit (the answer repeats most of a given file), one stream, tokens/s; against
  llama-server without and with its n-gram speculation;
- churn: 4 streams asking new ~300-token prompts one after another, tokens/s;
- prefill: cold prompts of ~512, ~2k and ~4k tokens (and ~8k with `--ctx 8192` or
  more), one at a time, prompt tokens computed per second (the prompt's tokens over the
  time to first token; every round and size a document neither server has seen);
- arrivals: requests arriving as a Poisson process (16 at 0.25/s, below saturation, and
  16 at 1/s, above it), prompts of ~300-2,600 distinct tokens, 64 tokens out with
  `ignore_eos`, the same schedule for every server: time to first token p50 and p99,
  the p99 gap between two streamed tokens, and output tokens/s over the whole run.

`--barrel default,shared` runs several Barrel daemons side by side, each
with its own settings (VARIANTS), every one compared with the same llama-server rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from barrel.engine.model import BATCH_INVARIANT_ENV, TILED_MATMUL_ENV, cpu_has_amx
from barrel.store import bundled
from bench.http import CTX, start_daemon, wait_ready

LLAMA_CPP_PYTHON = "0.3.36"
PARALLEL = 8
# Barrel daemons a run may put side by side: [models.defaults] lines of each
VARIANTS = {
    "default": "",  # on a CPU: a KV stream per sequence, flash attention "auto" (on)
    "invariant": "",  # batch-invariant kernels: no tiled matmul, no repacked weights
    "shared": "kv_per_sequence = false",  # one KV stream for all, flash attention on
    "shared-flash-off": 'kv_per_sequence = false\nflash_attn = "off"',
    "per-sequence-flash-on": 'kv_per_sequence = true\nflash_attn = "on"',  # llama-server's
    "extra-buffers": "extra_buffers = true",  # CPU repack weight buffers, as llama-server
    "extra-buffers-flash-on": 'extra_buffers = true\nflash_attn = "on"',
    "tiled": "",  # ggml's tiled K-quant matmul on (llama.cpp's default), see VARIANT_ENV
    "extra-buffers-tiled": "extra_buffers = true",  # both prefill kernels llama-server has
    # llama-server's kernels: repacked weights, the tiled matmul and flash attention
    "llama-kernels": 'extra_buffers = true\nflash_attn = "on"',
    "arrival": 'prefill_order = "arrival"',  # prompts read in the order they came
    # steps (and micro-batches) of up to 2,048 rows, each up to ~10 s: llama-server's steps
    "big": "num_batch = 2048\nprefill_step_s = 10",
}
# ... and the environment of each, where it differs
VARIANT_ENV = {
    "invariant": {BATCH_INVARIANT_ENV: "1"},
    "tiled": {TILED_MATMUL_ENV: "1"},
    "extra-buffers-tiled": {TILED_MATMUL_ENV: "1"},
    "llama-kernels": {TILED_MATMUL_ENV: "1"},
}
FILE = "\n\n".join(
    f'''def shape_{i}(width, height):
    """Area and perimeter of rectangle number {i}."""
    area = width * height
    perimeter = 2 * (width + height)
    return area, perimeter'''
    for i in range(8)
)
CODE_EDIT = (
    "Rename the parameter width to w everywhere in this file and print the whole file:"
    f"\n\n```python\n{FILE}\n```"
)


def llama_server() -> Path:
    """The cached llama-server binary, built on first use."""
    home = bundled.cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON}"
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit(
            "bench.peers builds llama-server with cmake: install it (pip install cmake)"
        )
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"),
                *("--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp),
            ],
            check=True,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (source,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
        shutil.copytree(source, home / "src", dirs_exist_ok=True)
    flags = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    flags += ["-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"]
    subprocess.run([cmake, "-S", str(home / "src"), "-B", str(home / "build"), *flags], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        [cmake, "--build", str(home / "build"), "--target", "llama-server", "-j", jobs],
        check=True,
    )
    return binary


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_server(
    model: Path, *extra: str, ctx: int = CTX
) -> tuple[subprocess.Popen[bytes], str]:
    """llama-server on `model`; on a CPU with AMX without its repacked weights, which
    the pinned llama.cpp puts in AMX buffers and then dies on (SIGILL), as Barrel's
    `extra_buffers = "auto"` leaves them off there (bench/NOTEBOOK.md, "AMX")."""
    port = free_port()
    command = [str(llama_server()), "-m", str(model), "--port", str(port)]
    command += ["-c", str(ctx * PARALLEL), "-np", str(PARALLEL), "--jinja", *extra]
    command += ["--no-repack"] if cpu_has_amx() else []
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    tokens: int,
    ignore_eos: bool = False,
    extra: dict[str, object] | None = None,
) -> tuple[float, int, float, str]:
    """(time to first content, tokens, end time, text) of one streamed chat: the tokens
    from the last chunk's usage (a speculating server sends several a chunk), else the
    content chunks. Tool-call argument pieces count as content; `extra` goes into the
    body."""
    body = {"model": "qwen", "messages": messages, "temperature": 0, "max_tokens": tokens}
    body |= {"ignore_eos": True} if ignore_eos else {}
    body |= extra or {}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, chunks, text, used = 0.0, 0, "", 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            used = (frame.get("usage") or {}).get("completion_tokens") or used
            delta = (frame.get("choices") or [{}])[0].get("delta") or {}
            piece = delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                piece += (call.get("function") or {}).get("arguments") or ""
            if piece:
                first = first or time.perf_counter() - start
                chunks += 1
                text += piece
    return first, used or chunks, time.perf_counter(), text


async def throughput(session: aiohttp.ClientSession, url: str, clients: int, n: int) -> float:
    asks = [
        [{"role": "user", "content": f"Client {i}: write the numbers 1 to 200 in words."}]
        for i in range(clients)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(session, url, m, n) for m in asks))
    return sum(r[1] for r in results) / (max(r[2] for r in results) - start)


WORDS = [
    "river",
    "stone",
    "cloud",
    "orange",
    "market",
    "window",
    "garden",
    "copper",
    "lamp",
    "field",
    "ledger",
    "harbour",
    "pepper",
    "violet",
    "anchor",
    "meadow",
]


async def churn(
    session: aiohttp.ClientSession, url: str, round_no: int, clients: int = 4, each: int = 3
) -> float:
    """Aggregate tokens/s of `clients` streams that each ask `each` questions in turn, every
    one a new ~300-token prompt answered in 128 tokens (`ignore_eos`, equal lengths): new
    prompts to prefill while other streams decode, GuideLLM's mix."""
    rnd = random.Random(round_no)
    words = WORDS[:10]

    def ask() -> list[dict[str, str]]:
        text = " ".join(f"{rnd.choice(words)}{rnd.randint(0, 999)}" for _ in range(90))
        return [{"role": "user", "content": f"Summarise these notes: {text}"}]

    asks = [[ask() for _ in range(each)] for _ in range(clients)]

    async def client(mine: list[list[dict[str, str]]]) -> int:
        tokens = 0
        for messages in mine:
            tokens += (await stream(session, url, messages, 128, ignore_eos=True))[1]
        return tokens

    start = time.perf_counter()
    done = await asyncio.gather(*(client(mine) for mine in asks))
    return sum(done) / (time.perf_counter() - start)


async def follow_up_ttft(
    session: aiohttp.ClientSession, url: str, round_no: int, pause: float = 0.0
) -> float:
    """A ~1,500-token conversation, answered turn by turn; the last turn's TTFT, asked
    `pause` seconds after the answer before it (a person reading it and typing)."""
    notes = " ".join(f"Fact {round_no}.{k}: item {k} costs {k * 3} coins." for k in range(120))
    messages = [{"role": "system", "content": f"You keep a ledger. {notes}"}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"What does item {turn * 7} cost?"})
        _, _, _, answer = await stream(session, url, messages, 24)
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": "And item 50?"})
    await asyncio.sleep(pause)
    first, _, _, _ = await stream(session, url, messages, 4)
    return first


async def cold_ttft(session: aiohttp.ClientSession, url: str, round_no: int) -> float:
    """The TTFT of a ~1,900-token prompt new to the server (a pasted document)."""
    notes = " ".join(f"Entry {round_no}.{k}: box {k} holds {k * 7 % 90} nails." for k in range(110))
    ask = [{"role": "user", "content": f"{notes}\nWhich box holds the most nails?"}]
    first, _, _, _ = await stream(session, url, ask, 4)
    return first


TOKENS_A_LINE = 13.2  # Qwen2.5's tokens in one line of `document`, measured


def document(tokens: int, seed: int) -> str:
    """About `tokens` tokens of ledger lines drawn from `seed`: a text no server has seen
    unless the seed repeats."""
    rnd = random.Random(seed)
    return "\n".join(
        f"{rnd.choice(WORDS)} {rnd.randint(0, 9999)} went to {rnd.choice(WORDS)} "
        f"{rnd.randint(0, 99)}."
        for _ in range(max(1, round(tokens / TOKENS_A_LINE)))
    )


async def first_token(
    session: aiohttp.ClientSession, url: str, body: dict[str, object]
) -> tuple[float, list[float], int]:
    """One streamed chat: (time to first content, the arrival time of each content chunk
    after the first, prompt tokens from the usage)."""
    body = {"model": "qwen", "temperature": 0, **body, "stream": True}
    body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    first, arrivals, prompt = 0.0, [], 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            prompt = (frame.get("usage") or {}).get("prompt_tokens") or prompt
            choices = frame.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter() - start
                if first:
                    arrivals.append(now)
                first = first or now
    return first, arrivals, prompt


async def cold_prefill(session: aiohttp.ClientSession, url: str, round_no: int, size: int) -> float:
    """Prompt tokens computed per second on a cold prompt of about `size` tokens."""
    ask = f"{document(size - 24, round_no * 1000 + size)}\nWhich entry has the largest number?"
    ttft, _, prompt = await first_token(
        session, url, {"messages": [{"role": "user", "content": ask}], "max_tokens": 1}
    )
    return prompt / ttft


TRACE = bool(os.environ.get("BARREL_BENCH_TRACE"))  # print each arrival's first token


def arrival_plan(rate: float, count: int, seed: int) -> list[tuple[float, int]]:
    """(seconds after the start, prompt tokens) of `count` requests arriving as a Poisson
    process of `rate` a second, prompts of 300-2,600 tokens."""
    rnd = random.Random(seed)
    at, plan = 0.0, []
    for _ in range(count):
        plan.append((at, rnd.randint(300, 2600)))
        at += rnd.expovariate(rate)
    return plan


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


async def arrivals(
    session: aiohttp.ClientSession, url: str, round_no: int, rate: float, count: int = 16
) -> dict[str, float]:
    """Requests on the schedule of `arrival_plan` (the same for every server in a round),
    each a new document answered in 64 tokens with `ignore_eos`."""
    plan = arrival_plan(rate, count, round_no)
    start = time.perf_counter()

    async def one(i: int, at: float, size: int) -> tuple[float, list[float], int]:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        # new to every server: a seed of its own for each round, rate and request
        seed = 10_000 * (round_no + 1) + 100 * round(rate * 100) + i
        text = f"{document(size, seed)}\nSummarise these entries."
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 64}
        ttft, chunks, _ = await first_token(session, url, {**body, "ignore_eos": True})
        if TRACE:  # one line a request, to pair the servers' requests afterwards
            print(f"  {url} {rate:g}/s #{i} at {at:.1f}s {size} tok ttft {ttft:.2f}s", flush=True)
        return ttft, [ttft, *chunks], len(chunks) + 1

    done = await asyncio.gather(*(one(i, at, size) for i, (at, size) in enumerate(plan)))
    elapsed = time.perf_counter() - start
    ttfts = [ttft for ttft, _, _ in done]
    gaps = [b - a for _, times, _ in done for a, b in itertools.pairwise(times)]
    return {
        "TTFT p50 ms": 1000 * statistics.median(ttfts),
        "TTFT p99 ms": 1000 * percentile(ttfts, 0.99),
        "gap p99 ms": 1000 * percentile(gaps, 0.99),
        "tok/s": sum(n for _, _, n in done) / elapsed,
    }


async def code_edit(session: aiohttp.ClientSession, url: str, n: int) -> float:
    start = time.perf_counter()
    _, chunks, end, _ = await stream(session, url, [{"role": "user", "content": CODE_EDIT}], n)
    return chunks / (end - start)


# a value, or several named ones (each compared as "<key> <name>")
Workload = Callable[[aiohttp.ClientSession, str, int], Awaitable[float | dict[str, float]]]
PREFILL_SIZES = {"512": 512, "2k": 2048, "4k": 3968, "8k": 8000}
ARRIVAL_RATES = [0.25, 1.0]  # requests a second: below and above what the box serves


def workloads(
    names: set[str], tokens: int, ctx: int = CTX, rates: list[float] | None = None
) -> list[tuple[str, Workload]]:
    """(result key, run(session, url, round) -> value) of each measurement asked for."""

    def streams(clients: int) -> Workload:
        async def run(s: aiohttp.ClientSession, url: str, r: int) -> float:
            return await throughput(s, url, clients, tokens)

        return run

    async def edit(s: aiohttp.ClientSession, url: str, r: int) -> float:
        return await code_edit(s, url, 256)

    async def at_once(s: aiohttp.ClientSession, url: str, r: int) -> float:
        return await follow_up_ttft(s, url, r) * 1000

    async def after_1s(s: aiohttp.ClientSession, url: str, r: int) -> float:
        return await follow_up_ttft(s, url, r + 100, 1.0) * 1000

    async def cold(s: aiohttp.ClientSession, url: str, r: int) -> float:
        return await cold_ttft(s, url, r) * 1000

    async def new_prompts(s: aiohttp.ClientSession, url: str, r: int) -> float:
        return await churn(s, url, r)

    def prefill(size: int) -> Workload:
        async def run(s: aiohttp.ClientSession, url: str, r: int) -> float:
            return await cold_prefill(s, url, r, size)

        return run

    def arriving(rate: float) -> Workload:
        async def run(s: aiohttp.ClientSession, url: str, r: int) -> dict[str, float]:
            return await arrivals(s, url, r, rate)

        return run

    plan: list[tuple[str, Workload]] = []
    if "streams" in names:
        plan += [(f"{c} streams tok/s", streams(c)) for c in (1, 4, 8)]
    if "follow-up" in names:
        plan += [("follow-up TTFT ms", at_once), ("after 1 s TTFT ms", after_1s)]
    if "cold" in names:
        plan.append(("cold TTFT ms", cold))
    if "code-edit" in names:
        plan.append(("code edit tok/s", edit))
    if "churn" in names:
        plan.append(("churn tok/s", new_prompts))
    if "prefill" in names:
        plan += [
            (f"prefill {label} tok/s", prefill(size))
            for label, size in PREFILL_SIZES.items()
            if size + 64 <= ctx
        ]
    if "arrivals" in names:
        plan += [(f"arrivals {rate:g}/s", arriving(rate)) for rate in rates or ARRIVAL_RATES]
    return plan


async def measure(args: argparse.Namespace) -> None:
    model = bundled.assemble("qwen2.5-coder-0.5b")
    llama_server()  # build before timing anything
    timeout = aiohttp.ClientTimeout(total=900)
    results: dict[str, dict[str, list[float]]] = {}
    layouts: dict[str, list[list[int]]] = {}  # llama-server's busy slots, each round
    with tempfile.TemporaryDirectory() as tmp:
        barrels = {
            f"barrel {v}": start_daemon(
                Path(tmp), model, PARALLEL, VARIANTS[v], n, VARIANT_ENV.get(v), ctx=args.ctx
            )
            for n, v in enumerate(args.barrel)
        }
        servers = {
            **barrels,
            "llama-server": start_llama_server(model, ctx=args.ctx),
        }
        if "code-edit" in args.workloads:
            servers["llama-server+ngram"] = start_llama_server(
                model, "--spec-type", "ngram-simple", ctx=args.ctx
            )
        try:
            # a new connection per request: llama-server drops idle keep-alive ones
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                for name, (_, url) in servers.items():
                    ready = "/health/ready" if name in barrels else "/health"
                    await wait_ready(session, url, ready, timeout=120)
                    await throughput(session, url, 1, 8)  # warm-up (Barrel loads the model)
                plan = workloads(args.workloads, args.tokens, args.ctx, args.rates)
                pids = [proc.pid for proc, _ in servers.values()]
                for r in range(args.rounds):
                    # one workload at a time on every server, so that the drift of a
                    # noisy box between two compared numbers is seconds, not minutes;
                    # alternate who goes first (ABBA): neither always runs on a cooler box
                    for key, run in plan:
                        order = [
                            (name, url)
                            for name, (_, url) in servers.items()
                            if name != "llama-server+ngram" or key == "code edit tok/s"
                        ]
                        for name, url in order if r % 2 == 0 else order[::-1]:
                            await settle(pids)
                            if name == "llama-server" and key in SPLIT_KEYS:
                                task = asyncio.ensure_future(run(session, url, r))
                                busy = await busy_slots(session, url, SPLIT_KEYS[key], task)
                                layouts.setdefault(key, []).append(busy)
                                value = await task
                            else:
                                value = await run(session, url, r)
                            values = value if isinstance(value, dict) else {"": value}
                            for part, v in values.items():
                                line = f"{key} {part}" if part else key
                                results.setdefault(name, {}).setdefault(line, []).append(v)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    base = results["llama-server"]
    for name in barrels:
        ours = results[name]
        print(f"{name}:")
        for key in ours:
            compare(key, ours[key], base[key])
        if "code-edit" in args.workloads:
            theirs = results["llama-server+ngram"]["code edit tok/s"]
            compare("code edit vs +ngram", ours["code edit tok/s"], theirs)
    for key, rounds in layouts.items():
        shown = "  ".join(f"{ids} ({micro_batches(ids)})" for ids in rounds)
        print(f"llama-server's busy slots, {key.split(' tok/s')[0]} (micro-batches): {shown}")


# Stream workloads whose llama-server slots are reported: with a KV stream per slot
# llama.cpp decodes a step in one micro-batch for each run of consecutive slot ids, so
# slots [2, 5, 6, 7] cost two passes over the weights a step, [4, 5, 6, 7] one. Which
# slots it picks follows from what ran before; the report says which rounds split.
SPLIT_KEYS = {"4 streams tok/s": 4, "8 streams tok/s": 8}


def micro_batches(ids: list[int]) -> int:
    """Runs of consecutive ids: the micro-batches of a step over these sequences."""
    return sum(1 for i in ids if i - 1 not in ids)


async def busy_slots(
    session: aiohttp.ClientSession, url: str, want: int, task: asyncio.Future[float]
) -> list[int]:
    """llama-server's processing slots once `want` of them are (or the workload ended
    first, or 10 s passed: then the last answer)."""
    busy: list[int] = []
    deadline = time.monotonic() + 10
    while not task.done() and time.monotonic() < deadline:
        async with session.get(url + "/slots") as resp:
            slots = await resp.json() if resp.status == 200 else []
        busy = sorted(int(slot["id"]) for slot in slots if slot.get("is_processing"))
        if len(busy) >= want:
            break
        await asyncio.sleep(0.25)
    return busy


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def settle(pids: list[int], quiet: float = 0.5, limit: float = 30.0) -> None:
    """Wait until no server uses the CPU for `quiet` seconds (at most `limit`). A server's
    work after its answers (Barrel decodes a finished conversation's next-turn header
    0.2 s later) would otherwise run inside the next server's measurement, and two
    spinning thread pools on two cores slow each other down by far more than the work."""
    deadline = time.monotonic() + limit
    before = [cpu_seconds(pid) for pid in pids]
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet)
        now = [cpu_seconds(pid) for pid in pids]
        if all(b - a < 0.02 for a, b in zip(before, now, strict=True)):
            return
        before = now


def compare(label: str, ours: list[float], theirs: list[float]) -> None:
    """One line: both medians, their ratio, the median of the rounds' own ratios (each
    round's two numbers were measured seconds apart, so the box's drift between rounds
    cancels out of it) with its bootstrap interval, and each side's rounds."""
    o, b = statistics.median(ours), statistics.median(theirs)
    ratios = [x / y for x, y in zip(ours, theirs, strict=True)]
    low, high = interval(ratios)
    each = " / ".join(" ".join(f"{v:.0f}" for v in side) for side in (ours, theirs))
    print(
        f"{label:>22}: barrel {o:8.1f}  llama-server {b:8.1f}  ratio {o / b:.2f}x"
        f"  paired {statistics.median(ratios):.2f}x [{low:.2f}, {high:.2f}]  (rounds: {each})"
    )


def interval(ratios: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """The central `level` of the paired ratio's bootstrap distribution: the median of
    the rounds drawn again with replacement, `draws` times (a fixed seed, so one run's
    numbers print the same interval). Few rounds give a wide interval, which is the point:
    a line whose interval straddles its threshold is not decided by that run."""
    rnd = random.Random(0)
    medians = sorted(statistics.median(rnd.choices(ratios, k=len(ratios))) for _ in range(draws))
    cut = int(draws * (1 - level) / 2)
    return medians[cut], medians[draws - 1 - cut]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument(
        "--barrel",
        type=lambda text: text.split(","),
        default=["default"],
        help=f"comma-separated Barrel settings to run side by side: {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--workloads",
        type=lambda text: set(text.split(",")),
        default={"streams", "follow-up", "cold", "code-edit", "churn"},
        help="comma-separated: streams, follow-up, cold, code-edit, churn, prefill, arrivals"
        " (default: the first five)",
    )
    parser.add_argument(
        "--ctx", type=int, default=CTX, help="context per sequence (8192+ adds the ~8k prefill)"
    )
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=ARRIVAL_RATES,
        help="arrival rates (requests a second) of the arrivals workload",
    )
    args = parser.parse_args()
    if unknown := set(args.barrel) - set(VARIANTS):
        parser.error(f"unknown --barrel settings: {', '.join(sorted(unknown))}")
    if args.build_only:
        print(llama_server())
        return
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
