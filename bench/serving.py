"""GuideLLM, a serving benchmark users know, against Barrel and llama-server in one run,
on Qwen2.5-Coder-0.5B Q4_K_M, with the tokenizer read offline from the GGUF file.

    .venv/bin/python -m bench.serving [--profile concurrent|constant|poisson|sweep]
        [--streams 4] [--rate 0.5] [--sweep 5] [--requests 24] [--defaults 'k = v']

GuideLLM (and the transformers and torch it needs) lives in its own virtual environment
under the models cache, installed on first use: a measuring stick, never a dependency.
The tokenizer comes out of the GGUF through transformers' GGUF reader, so nothing is
fetched from the Hugging Face hub. Both servers get the same model file, context and
parallel sequences (bench/peers' settings); GuideLLM sends synthetic chat requests (a
fixed prompt and answer length, streamed, a seed) with one of its profiles (`--profile`:
a fixed concurrency, a constant or Poisson rate, or a sweep of rates), first to one
server, then to the other, then once more each (ABBA; each run after both servers
have been idle for half a second, as in bench/peers; the first pair of runs gets the
prompts of one seed, the second pair another's, so that no server meets a prompt it
has cached), and reports per-request TTFT, inter-token latency and output throughput;
this script prints their percentiles side by side (a sweep: each server's curve).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from barrel.store import bundled
from bench.http import MODEL, start_daemon, wait_ready
from bench.peers import PARALLEL, llama_server, settle, start_llama_server

GUIDELLM = "guidellm==0.8.1"
FIGURES = [("time_to_first_token_ms", "TTFT ms"), ("inter_token_latency_ms", "ITL ms")]


def guidellm_env() -> Path:
    """The cached virtual environment with GuideLLM, built on first use."""
    home = bundled.cache_dir() / "guidellm-0.8.1"
    python = home / "bin" / "python"
    if not (home / ".ready").exists():
        subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, GUIDELLM, "gguf"], check=True)
        (home / ".ready").touch()
    return home


def tokenizer_dir(env: Path, gguf: Path) -> Path:
    """The model's tokenizer, exported from its GGUF file by transformers."""
    out = bundled.cache_dir() / "qwen2.5-coder-0.5b-tokenizer"
    if not (out / "tokenizer.json").exists():
        script = (
            "import sys\nfrom transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])\n"
            "t.save_pretrained(sys.argv[3])\n"
        )
        python = str(env / "bin" / "python")
        subprocess.run([python, "-c", script, str(gguf.parent), gguf.name, str(out)], check=True)
    return out


def run_guidellm(
    env: Path,
    url: str,
    model: str,
    tokenizer: Path,
    args: argparse.Namespace,
    out: Path,
    seed: int,
) -> dict[str, Any]:
    command = [
        str(env / "bin" / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model},request_format=/v1/chat/completions",
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt},output_tokens={args.output}",
        "--profile",
        profile(args),
        "--constraint",
        f"kind=max_requests,count={args.requests}",
        "--seed",
        f"kind=static,value={seed}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    subprocess.run(command, check=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def profile(args: argparse.Namespace) -> str:
    """GuideLLM's --profile for `args.profile`: a fixed concurrency, requests at a
    constant rate or as a Poisson process of that rate, or a sweep (GuideLLM measures
    the synchronous and the throughput rate, then `args.sweep` rates between them)."""
    if args.profile == "concurrent":
        return f"kind=concurrent,streams={args.streams}"
    if args.profile in ("constant", "poisson"):
        return f"kind={args.profile},rate={args.rate}"
    return f"kind=sweep,sweep_size={args.sweep}"


def summary(benchmark: dict[str, Any], figure: str) -> dict[str, float]:
    """A figure's mean and p50/p90/p99 over one benchmark's successful requests."""
    found = benchmark["metrics"][figure]["successful"]
    return {"mean": float(found["mean"]), **{k: float(v) for k, v in found["percentiles"].items()}}


def table(reports: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, float]]:
    """(figure, Barrel, llama-server): each the mean over that server's runs."""

    def both(figure: str, key: str) -> tuple[float, float]:
        ours = [summary(r["benchmarks"][0], figure)[key] for r in reports["barrel"]]
        theirs = [summary(r["benchmarks"][0], figure)[key] for r in reports["llama-server"]]
        return sum(ours) / len(ours), sum(theirs) / len(theirs)

    rows = [
        (f"{label} {q}", *both(figure, q))
        for figure, label in FIGURES
        for q in ("p50", "p90", "p99")
    ]
    rows.append(("output tok/s (all streams)", *both("output_tokens_per_second", "mean")))
    rows.append(("output tokens a request", *both("output_token_count", "mean")))
    return rows


def strategy(benchmark: dict[str, Any]) -> str:
    """What a benchmark of a run measured: its strategy and rate (or streams)."""
    found = benchmark["config"]["strategy"]
    rate = found.get("rate") or found.get("streams")
    return f"{found['type_']} {rate:.3g}" if rate else str(found["type_"])


def curves(reports: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A sweep's benchmarks, a line each: every server measures its own synchronous and
    throughput rates and the rates between, so the points are not paired."""
    lines = []
    for name, runs in reports.items():
        for i, report in enumerate(runs):
            for benchmark in report["benchmarks"]:
                ttft = summary(benchmark, "time_to_first_token_ms")
                itl = summary(benchmark, "inter_token_latency_ms")
                out = summary(benchmark, "output_tokens_per_second")["mean"]
                lines.append(
                    f"{name:>12} run {i}  {strategy(benchmark):>18}: TTFT p50 {ttft['p50']:8.0f}"
                    f" p99 {ttft['p99']:8.0f} ms  ITL p50 {itl['p50']:6.1f} p99"
                    f" {itl['p99']:6.1f} ms  output {out:6.1f} tok/s"
                )
    return lines


async def ready(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for name, url in urls.items():
            path = "/health/ready" if name == "barrel" else "/health"
            await wait_ready(session, url, path, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--profile", choices=["concurrent", "constant", "poisson", "sweep"], default="concurrent"
    )
    parser.add_argument("--streams", type=int, default=4, help="concurrent: requests in flight")
    parser.add_argument("--rate", type=float, default=0.5, help="constant, poisson: requests/s")
    parser.add_argument("--sweep", type=int, default=5, help="sweep: rates measured")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--defaults", default="", help="TOML lines for Barrel's [models.defaults]")
    parser.add_argument("--reports", type=Path, default=Path(tempfile.gettempdir()) / "serving")
    args = parser.parse_args()
    args.reports.mkdir(parents=True, exist_ok=True)
    model = bundled.assemble("qwen2.5-coder-0.5b")
    env = guidellm_env()
    tokenizer = tokenizer_dir(env, model)
    llama_server()
    reports: dict[str, list[dict[str, Any]]] = {"barrel": [], "llama-server": []}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "barrel": start_daemon(Path(tmp), model, PARALLEL, args.defaults),
            "llama-server": start_llama_server(model),
        }
        names = {"barrel": MODEL, "llama-server": "qwen"}
        try:
            asyncio.run(ready({k: url for k, (_, url) in servers.items()}))
            for name, (_, url) in servers.items():  # warm-up: Barrel loads the model
                warm = argparse.Namespace(**{**vars(args), "requests": args.streams})
                run_guidellm(env, url, names[name], tokenizer, warm, args.reports / "warm.json", 1)
            # the prompts of a seed are new to both servers the first time each gets them
            order = [("barrel", 42), ("llama-server", 42), ("llama-server", 43), ("barrel", 43)]
            pids = [proc.pid for proc, _ in servers.values()]
            for i, (name, seed) in enumerate(order):
                out = args.reports / f"{i}-{name}.json"
                url = servers[name][1]
                asyncio.run(settle(pids))  # the last run's idle work ends first
                report = run_guidellm(env, url, names[name], tokenizer, args, out, seed)
                reports[name].append(report)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    print(f"GuideLLM, {profile(args)}, {args.prompt} -> {args.output} tokens")
    if args.profile == "sweep":
        print("\n".join(curves(reports)))
        return
    for label, ours, theirs in table(reports):
        ratio = ours / theirs
        print(f"{label:>28}: barrel {ours:8.1f}  llama-server {theirs:8.1f}  ratio {ratio:.2f}x")


if __name__ == "__main__":
    main()
