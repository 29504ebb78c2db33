"""`barrel serve` as a real subprocess on a free port."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import ollama
import pytest

from tests.daemon import Daemon

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon("--cache-root", str(tmp_path / "cache"), cwd=tmp_path)
    try:
        d.wait_listening()
        yield d
    finally:
        d.kill()


async def test_serve_answers_health_ready_metrics_and_caps_bodies(daemon: Daemon) -> None:
    async with aiohttp.ClientSession(daemon.url) as http:
        async with http.get("/health") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok"}
        daemon_ready = False
        for _ in range(100):  # the tree boots right after the socket opens
            async with http.get("/health/ready") as resp:
                if resp.status == 200:
                    daemon_ready = (await resp.json())["status"] == "ready"
                    break
            await _tick()
        assert daemon_ready
        async with http.get("/metrics") as resp:
            text = await resp.text()
            assert "barrel_build_info" in text
            assert "barrel_http_requests_total" in text
            assert "process_cpu_seconds_total" in text
        async with http.post("/api/generate", data=b"\0" * (2 * 1024 * 1024)) as resp:
            assert resp.status == 413
            assert "exceeds the limit of 1048576 bytes" in (await resp.json())["error"]


async def _tick() -> None:
    await asyncio.sleep(0.05)


def test_sigterm_exits_0_within_10_seconds(daemon: Daemon) -> None:
    start = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(timeout=10) == 0
    assert time.monotonic() - start < 10
    log = daemon.output()
    assert "supervision tree stopped" in log
    assert "stopped" in log.splitlines()[-1]


def test_sigint_exits_0(daemon: Daemon) -> None:
    daemon.signal(signal.SIGINT)
    assert daemon.wait(timeout=10) == 0


def test_sigusr1_dumps_every_thread_stack(daemon: Daemon) -> None:
    daemon.signal(signal.SIGUSR1)
    daemon.wait_line(r"Thread 0x[0-9a-f]+", timeout=10)
    daemon.wait_line(r"File .*", timeout=10)
    assert daemon.proc.poll() is None, "SIGUSR1 must not stop the daemon"
    # One thread takes the signal and dumps with the GIL held; every other thread, native
    # ones included, blocks it, so it never lands in the middle of a thread starting.
    # The taker shows the signal unblocked only while in sigwait: it may still be writing
    # the dump, so wait for it to be back there.
    deadline = time.monotonic() + 10
    while True:
        taking = [t for t in _threads(daemon.proc.pid) if not _blocks(t, signal.SIGUSR1)]
        if taking or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(taking) == 1, taking
    assert taking[0].name != str(daemon.proc.pid), "not the main thread: its loop may be stuck"


def _threads(pid: int) -> list[Path]:
    return sorted(Path(f"/proc/{pid}/task").iterdir())


def _blocks(thread: Path, sig: signal.Signals) -> bool:
    for line in (thread / "status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigBlk in {thread}/status")


def test_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "http"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "barrel", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "server.port" in proc.stderr
    assert "Expected `int`" in proc.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[limits]\nmax_body = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "barrel", "serve", "--config", str(unknown)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "limits" in proc.stderr
    assert "max_body" in proc.stderr


def test_config_from_env_var_and_flags_override_it(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('[server]\nlog_level = "debug"\n[limits]\nmax_request_body_bytes = 10\n')
    d = Daemon(cwd=tmp_path, env={"BARREL_CONFIG": str(conf)})
    try:
        d.wait_listening()  # --port from the command line beat the file's default
        req = urllib.request.Request(f"{d.url}/api/chat", data=b"x" * 11, method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 413
    finally:
        d.kill()


def test_model_flag_needs_a_gguf_file(tmp_path: Path) -> None:
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("hello")
    for arg, message in [
        (f"demo={not_gguf}", "is not a GGUF file"),
        (f"demo={tmp_path / 'absent.gguf'}", "cannot read"),
        ("no-equals-sign", "expected NAME=PATH"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "barrel", "serve", "--model", arg],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, arg
        assert message in proc.stderr, proc.stderr


def test_model_flag_registers_a_local_gguf(tmp_path: Path, tiny_path: Path) -> None:
    d = Daemon("--model", f"tiny={tiny_path}", "--log-level", "info", cwd=tmp_path)
    try:
        d.wait_listening()
        d.wait_line(rf"registered model tiny -> {tiny_path}")
        client = ollama.Client(host=d.url, timeout=30)
        (listed,) = client.list().models
        assert listed.model == "tiny"
        assert listed.details.family == "qwen2"
        assert listed.size == tiny_path.stat().st_size
        info = client.show("tiny")
        assert "<tool_call>" in info.template
        assert "tools" in info.capabilities
        assert f"FROM {tiny_path}" in info.modelfile
    finally:
        d.kill()


def test_port_in_use_exits_1(tmp_path: Path, daemon: Daemon) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "barrel", "serve", "--port", str(daemon.port)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert "cannot listen" in proc.stdout  # logs go to stdout (journald-friendly)
