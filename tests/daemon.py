"""Run `barrel serve` as a subprocess and read its log as it comes."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Daemon:
    def __init__(
        self,
        *args: str,
        cwd: Path,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "barrel", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=preexec,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = 30.0) -> str:
        """Return the first log line, already read or still to come, that matches
        `pattern`; fail with the log so far."""
        rx = re.compile(pattern)
        for line in self.lines:
            if rx.search(line):
                return line
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r}:\n" + "\n".join(self.lines)
                ) from None
            if line is None:
                raise AssertionError(f"daemon exited before {pattern!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if rx.search(line):
                return line

    def wait_listening(self) -> None:
        self.wait_line(r"listening on http://127\.0\.0\.1:")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        """The whole log, after the process ended."""
        self.proc.wait(timeout=30)
        while True:
            line = self._queue.get(timeout=10)
            if line is None:
                return "\n".join(self.lines)
            self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def serve_models(
    tmp: Path, models: dict[str, Path], config: str = "", context: int = 2048
) -> Daemon:
    """`barrel serve` with these local models, its cache under `tmp`, a `context`-token
    context and `config` (more TOML under [models]), up with its tree running."""
    path = tmp / "barrel.toml"
    path.write_text(
        f'[models]\ncache_root = "{tmp / "cache"}"\nmax_context_size = {context}\n{config}\n'
    )
    args = [arg for name, p in models.items() for arg in ("--model", f"{name}={p}")]
    d = Daemon("--config", str(path), *args, cwd=tmp)
    d.wait_listening()
    d.wait_line("supervision tree up")
    return d
