"""systemd integration: sd_notify on a test NOTIFY_SOCKET, the watchdog and journald's
log form, with `barrel serve` as a subprocess."""

from __future__ import annotations

import logging
import signal
import socket
import time
from pathlib import Path

import pytest

from barrel.notify import JournalFormatter, notify, watchdog_interval
from tests.daemon import Daemon


def _receive(sock: socket.socket, wanted: str, timeout: float = 30.0) -> list[str]:
    """Datagrams until one holds `wanted`."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(wanted in g for g in got):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            raise AssertionError(f"no {wanted!r} among {got}") from None
    return got


def test_ready_after_boot_watchdog_then_stopping_on_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        config = tmp_path / "barrel.toml"
        config.write_text(f'[models]\ncache_root = "{tmp_path / "cache"}"\n')
        env = {
            "NOTIFY_SOCKET": str(path),
            "WATCHDOG_USEC": "400000",
            "JOURNAL_STREAM": "8:1234",
        }
        d = Daemon("--config", str(config), cwd=tmp_path, env=env)
        try:
            got = _receive(sock, "READY=1")
            d.wait_line("supervision tree up", timeout=1)  # READY=1 came after the boot
            assert "STATUS=serving on 127.0.0.1:" in got[-1]
            assert not any("STOPPING" in g for g in got)
            _receive(sock, "WATCHDOG=1", timeout=5)
            d.signal(signal.SIGTERM)
            _receive(sock, "STOPPING=1")
            assert d.wait(timeout=30) == 0
        finally:
            d.kill()
    log = d.output()
    # journald's form: a priority prefix, no time stamp (the journal adds its own)
    assert "<6>barrel.daemon: listening on http://127.0.0.1:" in log
    assert "<6>barrel.actors.runtime: supervision tree up" in log


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # another process's watchdog
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_PID")
    assert watchdog_interval() == 15.0


def test_abstract_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"barrel-test-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("READY=1")
        assert sock.recv(64) == b"READY=1"


def test_journal_formatter_prefixes_every_line_with_the_priority() -> None:
    fmt = JournalFormatter("%(name)s: %(message)s")
    record = logging.LogRecord("barrel.x", logging.ERROR, __file__, 1, "a\nb", None, None)
    assert fmt.format(record) == "<3>barrel.x: a\n<3>b"
    record = logging.LogRecord("barrel.x", logging.DEBUG, __file__, 1, "c", None, None)
    assert fmt.format(record) == "<7>barrel.x: c"
