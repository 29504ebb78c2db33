"""Barrel behind a real LLM gateway: two `barrel serve` daemons behind SMG's router
(the `smg` wheel), and the model-server metrics protocol those routers read."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon import Daemon, free_port, serve_models

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
HOLD: Any = {  # the only slot, for 1,500 tokens (~25 s), unless the stream is closed
    "model": "qwen",
    "messages": [{"role": "user", "content": "Write the numbers from 1 to 200 in words."}],
    "temperature": 0,
    "max_tokens": 1500,
    "logit_bias": {"151643": -100, "151645": -100},  # no end of turn
    "stream": True,
}


class Router:
    """`smg launch` over some daemons, its log kept for the assertions."""

    def __init__(self, tmp: Path, workers: list[str], *args: str) -> None:
        if not Path(SMG).exists():
            pytest.skip("the smg wheel is not installed")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"smg-{self.port}.log"
        command = [SMG, "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        command += ["--worker-urls", *workers, "--log-level", "debug", *args]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            self.wait_for(lambda: self.text().count("Detected backend:") >= len(workers))
            self.wait_for(lambda: self._ready(len(workers)))
        except BaseException:
            self.stop()
            raise

    def _ready(self, n: int) -> bool:
        try:
            workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return len(workers) == n and all(w.get("is_healthy") for w in workers)

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))

    def wait_for(self, ready: Any, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout  # a safety net: each check is an event
        while not ready():
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)

    def stop(self) -> None:
        """Killed: on SIGTERM smg keeps its listener open for a 5 s load-balancer
        settle window, and nothing here is about how the router stops."""
        self.proc.kill()
        self.proc.wait(timeout=10)


def metrics(url: str) -> dict[str, Any]:
    """The model-server families of one scrape: {name: family}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm")}


def value(families: dict[str, Any], name: str, model: str = "tiny") -> float:
    family = families[name]
    (sample,) = [s for s in family.samples if s.labels.get("model_name") == model]
    return float(sample.value)


def _sample(text: str, name: str, model: str) -> float:
    """One of Barrel's own per-model series from a /metrics text."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == model:
                return float(sample.value)
    raise AssertionError(f"no {name} for {model}")


def ps_context(daemon: Daemon, model: str) -> int:
    models = httpx.get(daemon.url + "/api/ps", timeout=10).json()["models"]
    (entry,) = [m for m in models if m["name"] == model]
    return int(entry["context_length"])


def scraped(url: str) -> Any:
    """A check that turns true once someone else (the router's load monitor) has read
    the daemon's /metrics since the check was made (this check's reads discounted)."""

    def scrapes() -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            if f.name == "barrel_http_requests"
            for s in f.samples
            if s.name.endswith("_total") and s.labels.get("route") == "/metrics"
        )

    base = scrapes()
    ours = 1  # the read above counts in the next one

    def check() -> bool:
        nonlocal ours
        seen = scrapes() - base - ours
        ours += 1
        return seen >= 1

    return check


def finished(url: str) -> float:
    """The daemon's own count of finished generations."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "barrel_engine_requests"
        for s in f.samples
        if s.name.endswith("_total")
    )


@contextmanager
def two_daemons(
    factory: pytest.TempPathFactory, name: str, models: dict[str, Path], config: str = ""
) -> Iterator[list[Daemon]]:
    """Two `barrel serve` daemons, both killed at the end (also when the second fails
    to start)."""
    daemons: list[Daemon] = []
    try:
        for i in (0, 1):
            daemons.append(serve_models(factory.mktemp(f"{name}{i}"), models, config))
        yield daemons
    finally:
        for d in daemons:
            d.kill()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[list[Daemon]]:
    with two_daemons(tmp_path_factory, "worker", {"tiny": tiny_path}) as daemons:
        yield daemons


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
def test_smg_identifies_barrel_and_reads_its_load(pair: list[Daemon], tmp_path: Path) -> None:
    # loads polled every second (SMG's default is every 10 s: the test waited for one)
    router = Router(
        tmp_path, [d.url for d in pair], "--policy", "power_of_two", "--load-monitor-interval", "1"
    )
    try:
        log = router.text()
        for d in pair:
            assert f"Detected backend: vllm for {d.url}" in log
        assert "Could not identify backend engine" not in log
        assert "returned 404" not in log

        # it reads the load from the vllm:* families of /metrics (with no KV-usage gauge
        # it records the load as unavailable and shows no engine_load)
        def engine_loads() -> dict[str, Any]:
            workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
            return {w["url"]: w for w in workers if (w.get("engine_load") or {}).get("loads")}

        router.wait_for(lambda: len(engine_loads()) == 2)
        for d in pair:
            worker = engine_loads()[d.url]
            assert worker["runtime_type"] == "vllm"
            assert worker["labels"]["served_model_name"] == "tiny"
            (load,) = worker["engine_load"]["loads"]
            assert 0 <= load["token_usage"] <= 1
    finally:
        router.stop()


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
def test_consistent_hashing_keeps_each_session_on_one_daemon(
    pair: list[Daemon], tmp_path: Path
) -> None:
    router = Router(tmp_path, [d.url for d in pair], "--policy", "consistent_hashing")
    try:
        homes: dict[str, int] = {}
        for key in ("alpha", "bravo", "charlie", "delta"):
            before = [finished(d.url) for d in pair]
            messages: list[dict[str, str]] = [
                {"role": "user", "content": f"Session {key}: tell me a story."}
            ]
            for turn in range(20):
                r = httpx.post(
                    router.url + "/v1/chat/completions",
                    headers={"x-smg-routing-key": key},
                    json={"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0},
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                body = r.json()
                if turn > 0:  # the daemon that holds the conversation reuses its KV
                    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, turn
                messages += [
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"Go on ({turn})."},
                ]
            grew = [finished(d.url) - b for d, b in zip(pair, before, strict=True)]
            assert sorted(grew) == [0, 20], (key, grew)  # all 20 turns on one daemon
            homes[key] = grew.index(20)
        assert len(homes) == 4
    finally:
        router.stop()


@pytest.fixture
def spare_pair(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[list[Daemon]]:
    """Two daemons of the test's own (one of them gets stopped)."""
    with two_daemons(tmp_path_factory, "failover", {"tiny": tiny_path}) as daemons:
        yield daemons


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
def test_failover_when_one_daemon_stops(spare_pair: list[Daemon], tmp_path: Path) -> None:
    daemons = spare_pair
    router = Router(tmp_path, [d.url for d in daemons], "--policy", "round_robin")
    results: list[int] = []
    try:

        def ask() -> int:
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                },
                timeout=60,
            )
            return r.status_code

        for _ in range(6):
            results.append(ask())
        assert results == [200] * 6
        assert all(finished(d.url) > 0 for d in daemons)  # both served
        daemons[0].signal(signal.SIGTERM)
        assert daemons[0].wait(timeout=30) == 0
        after = [ask() for _ in range(12)]
        assert after == [200] * 12, after  # nothing was in flight on the stopped one
        assert finished(daemons[1].url) >= 3 + 12
    finally:
        router.stop()


def _queue_behind(url: str, statuses: list[int]) -> list[threading.Thread]:
    """Two short requests sent to `url` in threads (they queue behind a held slot);
    their statuses go to `statuses`."""
    short = {**HOLD, "max_tokens": 3, "stream": False}

    def ask() -> None:
        r = httpx.post(url + "/v1/chat/completions", json=short, timeout=120)
        statuses.append(r.status_code)

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


@pytest.fixture(scope="module")
def solo(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = serve_models(
        tmp_path_factory.mktemp("protocol"),
        {"qwen": qwen_path, "tiny": tiny_path},
        "[models.defaults]\nnum_seq_max = 1\nqueue_depth = 4",
    )
    yield d
    d.kill()


def test_the_protocol_families_follow_the_live_state(solo: Daemon) -> None:
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(solo.url + "/v1/chat/completions", json=ask, timeout=60).status_code == 200
    ps = {m["name"]: m for m in httpx.get(solo.url + "/api/ps", timeout=10).json()["models"]}
    m = metrics(solo.url)
    for name, kind in [
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:gpu_cache_usage_perc", "gauge"),
        ("vllm:cache_config_info", "gauge"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:prefix_cache_hits", "counter"),
    ]:
        assert m[name].type == kind, name
    (config,) = m["vllm:cache_config_info"].samples
    assert config.labels == {
        "model_name": "tiny",
        "block_size": "1",
        "num_gpu_blocks": str(ps["tiny"]["context_length"]),
    }
    assert config.value == 1
    # KV usage counts running sequences: a finished one's cells stay parked for its next
    # turn (Barrel's own family shows them) but give way to new work, so they are no load
    queries = value(m, "vllm:prefix_cache_queries")
    hits = value(m, "vllm:prefix_cache_hits")
    long = {**ask, "messages": [{"role": "user", "content": "story " * 1200}]}
    first = httpx.post(solo.url + "/v1/chat/completions", json=long, timeout=60).json()
    prompt = first["usage"]["prompt_tokens"]
    again = httpx.post(solo.url + "/v1/chat/completions", json=long, timeout=60).json()
    reused = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused == prompt  # whole: the first token comes from the logits kept with it
    m = metrics(solo.url)
    assert value(m, "vllm:kv_cache_usage_perc") == 0
    assert value(m, "vllm:gpu_cache_usage_perc") == 0
    held = httpx.get(solo.url + "/metrics", timeout=30).text
    assert _sample(held, "barrel_engine_kv_cells_used", "tiny") >= prompt
    # prefix-cache counters are in tokens: two lookups of the prompt, one of them a hit
    assert value(m, "vllm:prefix_cache_queries") == queries + 2 * prompt
    assert value(m, "vllm:prefix_cache_hits") >= hits + reused


def test_queued_and_running_counts_during_a_held_slot(solo: Daemon) -> None:
    waiting: list[int] = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", solo.url + "/v1/chat/completions", json=HOLD) as held,
    ):
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert next(line for line in lines if line.startswith("data: "))
        queued = _queue_behind(solo.url, waiting)
        deadline = time.monotonic() + 60  # safety net: the state is polled, not timed
        while value(metrics(solo.url), "vllm:num_requests_waiting", "qwen") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        m = metrics(solo.url)
        assert value(m, "vllm:num_requests_waiting", "qwen") == 2
        assert value(m, "vllm:num_requests_running", "qwen") == 1
        assert value(m, "vllm:num_requests_waiting", "tiny") == 0  # per model
        # the held sequence's cells are load, and grow as it generates
        used = value(m, "vllm:kv_cache_usage_perc", "qwen")
        assert used >= 40 / ps_context(solo, "qwen")
        assert used == value(m, "vllm:gpu_cache_usage_perc", "qwen")
        while value(metrics(solo.url), "vllm:kv_cache_usage_perc", "qwen") <= used:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    for t in queued:  # the holder went away: both ran
        t.join(120)
    assert waiting == [200, 200]
    m = metrics(solo.url)
    assert value(m, "vllm:num_requests_waiting", "qwen") == 0
    assert value(m, "vllm:num_requests_running", "qwen") == 0


@pytest.fixture(scope="module")
def busy_pair(tmp_path_factory: pytest.TempPathFactory, qwen_path: Path) -> Iterator[list[Daemon]]:
    one_slot = "[models.defaults]\nnum_seq_max = 1\nqueue_depth = 4"
    with two_daemons(tmp_path_factory, "busy", {"qwen": qwen_path}, one_slot) as daemons:
        yield daemons


def test_load_aware_routing_avoids_the_daemon_whose_slot_is_held(
    busy_pair: list[Daemon], tmp_path: Path
) -> None:
    busy, free = busy_pair
    router = Router(
        tmp_path,
        [d.url for d in busy_pair],
        "--policy",
        "power_of_two",
        "--load-monitor-interval",
        "1",
    )
    short = {**HOLD, "max_tokens": 2, "stream": False}
    statuses: list[int] = []
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", busy.url + "/v1/chat/completions", json=HOLD) as held,
        ):
            # the busy daemon's only slot is held and two requests queue behind it, all
            # sent to it directly: only its metrics tell the router
            lines = held.iter_lines()  # kept: a dropped iterator closes the stream
            assert next(line for line in lines if line.startswith("data: "))
            queued = _queue_behind(busy.url, statuses)

            def seen_busy() -> bool:
                workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
                for w in workers:
                    if w["url"] == busy.url:
                        loads = (w.get("engine_load") or {}).get("loads") or [{}]
                        return bool(loads[0].get("num_waiting_reqs", 0) >= 2)
                return False

            router.wait_for(seen_busy)
            before = finished(free.url)
            for _ in range(3):
                # SMG adds 1,024 tokens of expected work per request it sent since its
                # last poll of a worker: each request goes after a fresh poll of the free
                # daemon, so the choice is made on the loads the daemons report
                router.wait_for(scraped(free.url))
                r = httpx.post(router.url + "/v1/chat/completions", json=short, timeout=120)
                assert r.status_code == 200, r.text
            assert finished(free.url) - before == 3  # every one went to the free daemon
        for t in queued:
            t.join(120)
        assert statuses == [200, 200]
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("headers", "session"),
    [
        ({"x-smg-routing-key": "k1"}, "k1"),
        ({"x-session-id": "s1", "x-smg-routing-key": "k1"}, "s1"),
        ({"x-conversation-id": "c1", "x-session-id": "s1"}, "c1"),
        ({"x-session-id": ""}, None),
        ({}, None),
    ],
)
def test_router_session_headers_are_the_kv_session_key(
    headers: dict[str, str], session: str | None
) -> None:
    from aiohttp.test_utils import make_mocked_request

    from barrel.http.generate import conversation_of

    assert conversation_of(make_mocked_request("POST", "/v1/chat/completions", headers)) == session
