"""Completing asyncio futures from other threads.

Both run on the future's loop (scheduled with `call_soon_threadsafe`) and do nothing if
the future is already done, e.g. cancelled by a timeout while the answer was on its way.
"""

from __future__ import annotations

import asyncio
from typing import Any


def resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
