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
    for n in range(1, cycles + 1):
        cycle(client, model)
        rss.append(resident_kb(pid))  # as the daemon left it: no collection asked for
        seen.append(counts(pid))
        if n in (SETTLED, cycles):
            memory = client.get("/debug/memory").json()  # after a full collection
            assert memory["tracing"], memory
            traced.append(memory["traced"])
    # what the first cycles leave is kept once (guides/operations.md): the measure starts
    # after the third, and no later cycle adds 1 MB to it. It was +1.6 to +2.5 MB a cycle
    # before barrel.heap's two arenas; +0.7 MB a cycle until the collector's next full
    # pass (a stopped engine's rooms in reference cycles) before its collection at each
    # unload; a one-time ~5 MB step at the second to fourth Qwen cycle in two runs of
    # three before its fixed mmap threshold.
    print(model, "unloaded RSS kB", rss, "traced", traced, "fds/threads", seen)
    rss, seen = rss[SETTLED - 1 :], seen[SETTLED - 1 :]
    assert max(rss) - rss[0] <= 1024, f"unloaded RSS after each cycle from the third (kB): {rss}"
    # the Python heap: a few timers and metrics labels, never a model's worth
    assert traced[1] - traced[0] <= 256 * 1024, traced
    assert len(set(seen)) == 1, f"fds and threads after each cycle from the third: {seen}"
