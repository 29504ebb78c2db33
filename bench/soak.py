"""A soak run: a daemon under mixed, hostile-ish traffic for a set time.

    .venv/bin/python -m bench.soak [--minutes 30] [--clients 6]

`barrel serve` runs as a subprocess with the tiny model, a registry on 127.0.0.1 and
fault injection on. Clients pick actions at random: chat in all three dialects,
streaming or not, streams left after a few lines (client disconnects), keep_alive 0,
creates (and deletes) from the import directory, pulls (and deletes) from the registry,
and engine crashes (POST /debug/crash). Every request has a 120 s limit. Reported:
requests by outcome, hung requests (goal 0), unexpected 5xx (goal 0: 503 and 529 are
the documented "busy" answers), daemon deaths (goal 0) and the daemon's RSS over time.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from barrel.store.synthetic import tiny_model
from tests.daemon import Daemon
from tests.registry_server import RegistryServer

LIMIT_S = 120.0
ASK = [{"role": "user", "content": "Tell me a short story about a barrel."}]


class Soak:
    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.pid = pid
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.hung = 0
        self.names = 0

    def note(self, action: str, status: int | str) -> None:
        self.outcomes[f"{action} {status}"] += 1
        if isinstance(status, int) and status >= 500 and status not in (503, 529):
            self.unexpected.append(f"{action} {status}")

    async def run(self, http: aiohttp.ClientSession, action: str) -> None:
        try:
            await asyncio.wait_for(getattr(self, action)(http), LIMIT_S)
        except TimeoutError:
            self.hung += 1
            self.note(action, "hung")
        except aiohttp.ClientError as exc:
            self.note(action, type(exc).__name__)

    async def _post(self, http: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, str]:
        async with http.post(self.url + path, json=body) as r:
            return r.status, await r.text()

    async def _stream(
        self, http: aiohttp.ClientSession, action: str, path: str, body: Any, leave: bool
    ) -> None:
        async with http.post(self.url + path, json=body) as r:
            if r.status != 200:
                self.note(action, r.status)
                return
            lines = 0
            errored = False
            async for line in r.content:
                lines += 1
                errored = errored or b'"error"' in line or line.startswith(b"event: error")
                if leave and lines >= 3:
                    self.note(action + "-left", 200)
                    return  # the client goes away mid-stream
            self.note(action + ("-error-frame" if errored else ""), 200)

    async def openai(self, http: aiohttp.ClientSession) -> None:
        stream = random.random() < 0.6
        body = {"model": "tiny", "messages": ASK, "max_tokens": 64, "stream": stream}
        if stream:
            await self._stream(http, "openai", "/v1/chat/completions", body, random.random() < 0.2)
        else:
            self.note("openai", (await self._post(http, "/v1/chat/completions", body))[0])

    async def anthropic(self, http: aiohttp.ClientSession) -> None:
        stream = random.random() < 0.6
        body = {"model": "tiny", "messages": ASK, "max_tokens": 64, "stream": stream}
        if stream:
            await self._stream(http, "anthropic", "/v1/messages", body, random.random() < 0.2)
        else:
            self.note("anthropic", (await self._post(http, "/v1/messages", body))[0])

    async def ollama(self, http: aiohttp.ClientSession) -> None:
        stream = random.random() < 0.6
        body = {"model": "tiny", "messages": ASK, "options": {"num_predict": 64}, "stream": stream}
        if stream:
            await self._stream(http, "ollama", "/api/chat", body, random.random() < 0.2)
        else:
            self.note("ollama", (await self._post(http, "/api/chat", body))[0])

    async def unload(self, http: aiohttp.ClientSession) -> None:
        status, _ = await self._post(http, "/api/generate", {"model": "tiny", "keep_alive": 0})
        self.note("unload", status)

    async def create(self, http: aiohttp.ClientSession) -> None:
        self.names += 1
        name = f"soak-{self.names}"
        body = {"model": name, "from": "tiny.gguf", "stream": False}
        status, _ = await self._post(http, "/api/create", body)
        self.note("create", status)
        if status == 200:
            async with http.delete(self.url + "/api/delete", json={"model": name}) as r:
                self.note("delete", r.status)

    async def pull(self, http: aiohttp.ClientSession) -> None:
        status, _ = await self._post(http, "/api/pull", {"model": "soak/pulled", "stream": False})
        self.note("pull", status)

    async def crash(self, http: aiohttp.ClientSession) -> None:
        self.note("crash", (await self._post(http, "/debug/crash", {"model": "tiny"}))[0])


ACTIONS = {
    "openai": 30,
    "anthropic": 25,
    "ollama": 25,
    "unload": 4,
    "create": 3,
    "pull": 3,
    "crash": 2,
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def soak(url: str, daemon: Daemon, minutes: float, clients: int) -> dict[str, Any]:
    s = Soak(url, daemon.proc.pid)
    deadline = time.monotonic() + minutes * 60
    rss: list[tuple[float, float]] = []
    start = time.monotonic()

    async def client() -> None:
        names, weights = zip(*ACTIONS.items(), strict=True)
        timeout = aiohttp.ClientTimeout(total=LIMIT_S + 10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while time.monotonic() < deadline and daemon.proc.poll() is None:
                await s.run(http, random.choices(names, weights)[0])

    async def sample() -> None:
        while time.monotonic() < deadline and daemon.proc.poll() is None:
            rss.append((round(time.monotonic() - start), rss_mb(daemon.proc.pid)))
            await asyncio.sleep(30)

    await asyncio.gather(sample(), *(client() for _ in range(clients)))
    alive = daemon.proc.poll() is None
    if alive:
        rss.append((round(time.monotonic() - start), rss_mb(daemon.proc.pid)))
    after_warmup = [m for t, m in rss if t >= 60] or [m for _, m in rss]
    return {
        "minutes": minutes,
        "requests": sum(s.outcomes.values()),
        "outcomes": dict(sorted(s.outcomes.items())),
        "hung": s.hung,
        "unexpected_5xx": len(s.unexpected),
        "daemon_deaths": 0 if alive else 1,
        "rss_mb": {
            "after_warmup": round(after_warmup[0], 1),
            "end": round(after_warmup[-1], 1),
            "max": round(max(after_warmup), 1),
        },
        "rss_samples": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=6)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="barrel-soak-"))
    tiny = tiny_model()
    imports = tmp / "imports"
    imports.mkdir()
    shutil.copy(tiny, imports / "tiny.gguf")
    (tmp / "registry").mkdir()
    registry = RegistryServer(tmp / "registry")
    registry.add_ollama_model("soak/pulled", "latest", tiny)
    config = tmp / "barrel.toml"
    config.write_text(
        "[server]\naccess_log = false\nfault_injection = true\n"
        f'[models]\ncache_root = "{tmp / "cache"}"\nimport_dir = "{imports}"\n'
        "max_context_size = 2048\n"
        "[supervision.models]\nintensity = 1000\nperiod_s = 60\n"
        f'[registry.hosts]\n"registry.ollama.ai" = "{registry.url}"\n'
    )
    daemon = Daemon("--config", str(config), "--model", f"tiny={tiny}", cwd=tmp)
    try:
        daemon.wait_listening()
        daemon.wait_line("supervision tree up")
        report = asyncio.run(soak(daemon.url, daemon, args.minutes, args.clients))
    finally:
        daemon.kill()
        registry.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["hung"] == report["unexpected_5xx"] == report["daemon_deaths"] == 0 else 1)


if __name__ == "__main__":
    main()
