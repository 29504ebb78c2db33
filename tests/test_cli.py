"""The `barrel` command against a daemon subprocess: every subcommand, pull progress from
a registry on 127.0.0.1, `barrel run` through a pseudo-terminal, and `barrel top`."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from barrel.cli.top import render_status
from barrel.client import BarrelClient
from tests.daemon import Daemon, free_port, serve_models
from tests.registry_server import RegistryServer
from tests.test_store import write_small_gguf

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    root = tmp_path_factory.mktemp("registry")
    server = RegistryServer(root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def imports(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Path:
    folder = tmp_path_factory.mktemp("imports")
    shutil.copy(tiny_path, folder / "tiny.gguf")
    return folder


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory,
    qwen_path: Path,
    tiny_path: Path,
    registry: RegistryServer,
    imports: Path,
) -> Iterator[Daemon]:
    d = serve_models(
        tmp_path_factory.mktemp("cli"),
        {"qwen": qwen_path, "tiny": tiny_path},
        # the registry serves a small header-only GGUF: no trial load for it
        f'import_dir = "{imports}"\ntrial_load = false\n[models.defaults]\nnum_seq_max = 1\n'
        f'[registry.hosts]\n"registry.ollama.ai" = "{registry.url}"\n',
    )
    yield d
    d.kill()


def barrel(
    daemon: Daemon | None, *args: str, stdin: str | None = None, host: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BARREL_HOST": host or (daemon.url if daemon else ""), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "barrel", *args],
        env=env,
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_daemon_that_is_down_is_one_line_and_exit_1() -> None:
    r = barrel(None, "list", host=f"127.0.0.1:{free_port()}")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "barrel serve" in lines[0]
    assert r.stdout == ""


def test_pull_shows_progress_then_the_model_is_listed(
    daemon: Daemon, registry: RegistryServer, tmp_path: Path
) -> None:
    gguf = write_small_gguf(tmp_path / "small.gguf", padding_bytes=4 << 20)
    digest = registry.add_ollama_model("library/small", "q4", gguf, params={"temperature": 0.3})
    r = barrel(daemon, "pull", "small:q4")
    assert r.returncode == 0, r.stderr
    assert f"pulling {digest.removeprefix('sha256:')[:12]}" in r.stderr
    assert "4.2/4.2 MB" in r.stderr  # the progress bar ran to the blob's size
    assert "success" in r.stderr.splitlines()
    listed = barrel(daemon, "ls")
    assert "small:q4" in listed.stdout


def test_run_pulls_a_model_it_does_not_have(
    daemon: Daemon, registry: RegistryServer, tiny_path: Path
) -> None:
    digest = registry.add_ollama_model("library/tinyrun", "latest", tiny_path)
    r = barrel(daemon, "run", "tinyrun", "Hello")
    assert r.returncode == 0, r.stderr
    assert f"pulling {digest.removeprefix('sha256:')[:12]}" in r.stderr
    assert "success" in r.stderr.splitlines()
    assert r.stdout.endswith("\n")  # the tiny model's answer (random text) ended
    assert "tinyrun:latest" in barrel(daemon, "ls").stdout


def test_a_failing_pull_exits_non_zero(daemon: Daemon) -> None:
    r = barrel(daemon, "pull", "missing:latest")
    assert r.returncode == 1
    assert "Error:" in r.stderr
    assert "missing" in r.stderr


def test_create_show_copy_edit_and_remove(daemon: Daemon, imports: Path) -> None:
    (imports / "Modelfile").write_text(
        "FROM ./tiny.gguf\nPARAMETER temperature 0.25\nSYSTEM You are terse.\n"
        'TEMPLATE "{{ .System }} {{ .Prompt }}"\n'
    )
    made = barrel(daemon, "create", "mini", "-f", str(imports / "Modelfile"))
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().endswith("success")
    assert "mini:latest" in barrel(daemon, "list").stdout
    details = barrel(daemon, "show", "mini").stdout
    assert "architecture" in details
    assert "qwen2" in details
    assert "temperature" in barrel(daemon, "show", "mini", "--parameters").stdout
    assert barrel(daemon, "show", "mini", "--template").stdout.strip() == (
        "{{ .System }} {{ .Prompt }}"
    )
    modelfile = barrel(daemon, "show", "mini", "--modelfile").stdout
    assert "FROM " in modelfile
    assert "You are terse." in modelfile
    assert barrel(daemon, "cp", "mini", "mini2").returncode == 0
    assert barrel(daemon, "edit", "mini2", "--set", "temperature=0.9").returncode == 0
    assert "0.9" in barrel(daemon, "show", "mini2", "--parameters").stdout
    assert "0.25" in barrel(daemon, "show", "mini", "--parameters").stdout
    gone = barrel(daemon, "rm", "mini2")
    assert gone.returncode == 0
    assert "mini2" not in barrel(daemon, "ls").stdout
    found = barrel(daemon, "search", "min")
    assert "mini:latest" in found.stdout
    missing = barrel(daemon, "show", "nope")
    assert missing.returncode == 1
    assert "not found" in missing.stderr


def test_run_one_shot_piped_ps_embed_stop_prune_version(daemon: Daemon) -> None:
    r = barrel(
        daemon, "run", "qwen", "What is the capital of France? Answer in one word.", "--verbose"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    rates = dict(line.split(":", 1) for line in r.stderr.strip().splitlines())
    assert float(rates["eval rate"].split()[0]) > 1  # tokens/s, as Ollama's --verbose
    assert int(rates["prompt eval count"].split()[0]) > 10
    # sampled at the default temperature: a request with the surest answer (a question
    # about France's capital was once answered with a refusal)
    piped = barrel(daemon, "run", "qwen", stdin="Repeat exactly: Paris is the capital of France.")
    assert "Paris" in piped.stdout
    ps = barrel(daemon, "ps").stdout
    assert "qwen" in ps
    assert "CONTEXT" in ps
    embedded = barrel(daemon, "embed", "qwen", "hello", "world").stdout.splitlines()
    assert len(embedded) == 2
    assert len(json.loads(embedded[0])) == 896
    assert barrel(daemon, "stop", "qwen").returncode == 0
    assert barrel(daemon, "unload", "qwen#embed").returncode == 0
    after = barrel(daemon, "ps").stdout
    assert "qwen" not in after
    pruned = barrel(daemon, "prune")
    assert pruned.returncode == 0
    assert "removed" in pruned.stdout
    version = barrel(daemon, "version").stdout
    assert "barrel client" in version
    assert "barrel daemon" in version


def _read_until(fd: int, marker: bytes, timeout: float = 120.0) -> bytes:
    buf = b""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} in {buf!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_run_holds_a_two_turn_conversation_through_a_pty(daemon: Daemon) -> None:
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "barrel", "run", "qwen"],
        env={**os.environ, "BARREL_HOST": daemon.url},
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        close_fds=True,
    )
    os.close(secondary)
    try:
        _read_until(primary, b">>> ")
        os.write(primary, b"/set parameter temperature 0\n")
        assert b"Set parameter 'temperature' to '0'" in _read_until(primary, b">>> ")
        os.write(primary, b"What is the capital of France? Answer in one word.\n")
        first = _read_until(primary, b">>> ")
        assert b"Paris" in first
        # a message over two lines, between triple quotes
        os.write(primary, b'"""What did I just ask you about?\n')
        _read_until(primary, b"... ")
        os.write(primary, b'Answer with the country."""\n')
        second = _read_until(primary, b">>> ")
        assert b"France" in second.split(b'country."""', 1)[-1]  # it remembers the first turn
        os.write(primary, b"/bye\n")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        os.close(primary)


def test_top_shows_a_loaded_model_its_queue_and_tokens_per_second(daemon: Daemon) -> None:
    long = {
        "model": "qwen",
        "messages": [
            {"role": "user", "content": "Write the numbers from 1 to 200 in words, one per line."}
        ],
        "options": {"temperature": 0, "num_predict": 300},
    }
    short = {**long, "options": {"num_predict": 2}, "stream": False}

    async def snapshot() -> dict[str, object]:
        """The status once the long answer streams and the short request waits behind it
        (one slot: num_seq_max = 1)."""
        async with BarrelClient(daemon.url) as client:
            while True:
                status = await client.status()
                (model,) = [m for m in status["models"] if m["name"] == "qwen"]  # type: ignore[attr-defined]
                if model["queued"] == 1 and model["tokens_per_s"] > 0:
                    return status
                await asyncio.sleep(0.1)

    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", daemon.url + "/api/chat", json=long) as held,
    ):
        lines = held.iter_lines()  # kept: a dropped iterator closes the stream
        assert json.loads(next(lines))["done"] is False
        waiting = threading.Thread(
            target=lambda: httpx.post(daemon.url + "/api/chat", json=short, timeout=120)
        )
        waiting.start()
        status = asyncio.run(asyncio.wait_for(snapshot(), 60))
    # the long answer is left (the daemon cancels it), the short one is served
    waiting.join(timeout=120)
    console = Console(record=True, width=200)
    console.print(render_status(status))
    text = console.export_text()
    (model,) = [m for m in status["models"] if m["name"] == "qwen"]  # type: ignore[attr-defined]
    assert model["running"] == 1
    assert model["queued"] == 1
    assert model["tokens_per_s"] > 0
    row = next(line for line in text.splitlines() if "qwen" in line and "busy" in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[5:8] == ["1", "1", f"{model['tokens_per_s']:.1f}"]  # active, queued, tok/s
    assert "POST /api/chat" in text or "Recent requests" in text
    top = barrel(daemon, "top", "--once")
    assert top.returncode == 0
    assert "Models" in top.stdout
    assert "qwen" in top.stdout
