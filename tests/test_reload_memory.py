"""A daemon that loads and unloads its models all day gives back what each load took:
its resident memory when nothing is loaded, its Python heap (tracemalloc), its file
descriptors and threads stay where they were after the first few cycles
(barrel.heap: glibc's arenas, the trim after an unload)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, serve_models

TINY_CYCLES = 20
QWEN_CYCLES = 5
SETTLED = 3  # cycles before the measure: caches and pools fill once


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, qwen_path: Path
) -> Iterator[Daemon]:
    os.environ["PYTHONTRACEMALLOC"] = "1"  # the daemon's Python heap is traced
    try:
        d = serve_models(
            tmp_path_factory.mktemp("reload"),
            {"tiny": tiny_path, "qwen": qwen_path},
            config="[server]\nfault_injection = true\n",  # GET /debug/memory
        )
    finally:
        del os.environ["PYTHONTRACEMALLOC"]
    yield d
    d.kill()


def resident_kb(pid: int) -> float:
    """VmRSS, the median of several readings."""
    readings = []
    for _ in range(7):
        status = Path(f"/proc/{pid}/status").read_text()
        readings.append(
            int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1])
        )
    return statistics.median(readings)


def counts(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def cycle(client: httpx.Client, model: str) -> None:
    """Load with a short answer, then unload, and wait until /api/ps says it is gone."""
    r = client.post(
        "/api/generate",
        json={"model": model, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 2
    r = client.post("/api/generate", json={"model": model, "keep_alive": 0})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120  # a safety net; the unload answers at once
    while client.get("/api/ps").json()["models"]:
        assert time.monotonic() < deadline, "the model was not unloaded"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "cycles"), [("tiny", TINY_CYCLES), ("qwen", QWEN_CYCLES)])
def test_load_unload_cycles_give_back_what_each_load_took(
    daemon: Daemon, model: str, cycles: int
) -> None:
    pid = daemon.proc.pid
    client = httpx.Client(base_url=daemon.url, timeout=120)
    for bad in ("x", "-1", "99999999999"):  # a 400, not a 500
        assert client.get("/debug/memory", params={"top": bad}).status_code == 400
    rss: list[float] = []
    traced: list[int] = []
    seen: list[tuple[int, int]] = []
    for _ in range(cycles):
        cycle(client, model)
        memory = client.get("/debug/memory").json()  # after a full collection
        assert memory["tracing"], memory
        traced.append(memory["traced"])
        rss.append(resident_kb(pid))
        seen.append(counts(pid))
    # what the first cycles leave is kept once (guides/operations.md): the measure starts
    # after the third. No cycle adds to the last: the median step between cycles is
    # ~0 (it was +1.6 to +2.5 MB a cycle before barrel.heap). A one-time step of 1-11 MB
    # was seen in some runs (2 of 5), once, then flat: bounded here, not yet explained.
    settled = SETTLED
    print(model, "unloaded RSS kB", rss, "traced", traced, "fds/threads", seen)
    steps = [b - a for a, b in zip(rss[settled:], rss[settled + 1 :], strict=False)]
    assert statistics.median(steps) <= 128, f"unloaded RSS per cycle (kB): {rss}"
    assert max(rss[settled:]) - rss[settled] <= 16 * 1024, f"unloaded RSS per cycle (kB): {rss}"
    # the Python heap: a few timers and metrics labels, never a model's worth
    assert max(traced[settled:]) - traced[settled] <= 256 * 1024, traced
    assert len(set(seen[settled:])) == 1, f"fds and threads per cycle: {seen}"
