"""systemd integration without a dependency: sd_notify over $NOTIFY_SOCKET, the watchdog
interval from $WATCHDOG_USEC, and log lines with syslog priority prefixes when stdout
goes to the journal ($JOURNAL_STREAM).

`barrel serve` sends READY=1 once the supervision tree is up, WATCHDOG=1 every half
watchdog interval while the event loop runs and the tree's root is alive, and STOPPING=1
when a signal starts the shutdown. Without NOTIFY_SOCKET every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

logger = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to systemd; False if not asked to."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        logger.warning("sd_notify %r failed: %s", state.split("\n")[0], exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when off."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.1, int(usec) / 1e6 / 2)
    except ValueError:
        return None


_PRIORITIES = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


class JournalFormatter(logging.Formatter):
    """`<priority>logger: message` — journald reads the prefix as the line's priority
    and stamps the time itself. Tracebacks stay in the same record."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITIES.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        text = super().format(record).replace("\n", "\n" + f"<{prio}>")
        return f"<{prio}>{text}"


def setup_logging(level: str) -> None:
    """Log to stdout: plain lines with a time stamp, or journald's form under systemd."""
    handler = logging.StreamHandler(sys.stdout)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
