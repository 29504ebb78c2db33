"""Bulk work that must not slow inference down: hashing an import, receiving a blob,
downloading a pull. It runs in a thread of its own at the lowest CPU priority (Linux
gives each thread its own nice value), so on a small box the engine threads keep their
cores and time to first token holds while a multi-GB file is hashed.
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

LOWEST = 19


def lower_priority() -> None:
    """Make the calling thread (only it) yield the CPU to everything else."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
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
