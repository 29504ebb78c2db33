"""Bulk work that must not slow inference down: hashing an import, receiving a blob,
downloading a pull. It runs in a thread of its own at a low CPU priority (Linux gives
each thread its own nice value), so on a small box the engine threads keep their cores
and time to first token holds while a multi-GB file is hashed.

Nice 10, not the lowest (19): a thread at 19 gets ~1.5 % of a core that anything else
wants, and what it starts inherits that (a create's trial load in a child process). On a
2-core box beside two busy processes a create of the tiny model took 152 s instead of
0.6 s; at 10 the thread gets ~10 % there, and engine threads at 0 still keep ~95 % of
their cores beside it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from barrel.futures import Reply

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOW = 10


def lower_priority() -> None:
    """Make the calling thread (only it), and what it starts, yield the CPU to the engine."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: run as is
        logger.debug("cannot lower this thread's priority: %s", exc)


async def in_background(fn: Callable[..., T], *args: object, name: str = "barrel-bulk") -> T:
    """`fn(*args)` in a new low-priority thread; its result (or error) on the loop."""
    reply: Reply[T] = Reply()

    def work() -> None:
        lower_priority()
        try:
            reply.resolve(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            reply.reject(exc)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await reply.wait(None)
