"""A time budget for pure-Python work that client input can make endless (a chat
template's loops): past it, an exception is raised inside the working thread.

`PyThreadState_SetAsyncExc` delivers the exception at the thread's next bytecode, so even
a loop of C calls stops. The delivery is armed only while the block runs (a lock orders
it against the block's end) and any pending one is withdrawn when the block ends, so it
can never land in whatever the thread does next (pool threads are reused).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Expired(BaseException):
    """Raised in the thread whose budget ran out. A BaseException, so that code which
    swallows ordinary errors (a template probe) cannot swallow it."""


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)


@contextmanager
def budget(seconds: float | None) -> Iterator[None]:
    """Run the block for at most `seconds` (None: no limit); `Expired` past it."""
    if seconds is None:
        yield
        return
    ident = threading.get_ident()
    lock = threading.Lock()
    running = True

    def expire() -> None:
        with lock:
            if running:
                _set_async_exc(ident, Expired)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            running = False
        timer.cancel()
        # Withdraw a delivery that was armed but has not landed yet.
        _set_async_exc(ident, ctypes.py_object())
