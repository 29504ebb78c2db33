"""A time budget for pure-Python work that client input can make endless (a chat
template's loops): past it, an exception is raised inside the working thread.

`PyThreadState_SetAsyncExc` delivers the exception at the thread's next bytecode, so even
a loop of C calls stops. The delivery is armed only while the block runs (a lock orders
it against the block's end), and one armed but not yet landed when the block ends is made
to land in the block's own exit and dropped there, so it can never land in whatever the
thread does next (pool threads are reused).

It is never withdrawn with `PyThreadState_SetAsyncExc(ident, NULL)`: on CPython 3.11 that
call raises the interpreter's "async exception pending" flag, and only a delivered
exception lowers it again. With the flag left up, the next call made under a trace or
profile function (pdb, debugpy, coverage, cProfile) spins for ever.
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
    running, armed, landed = True, False, False

    def expire() -> None:
        nonlocal armed
        with lock:
            if running:
                armed = _set_async_exc(ident, Expired) == 1

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Expired:
        landed = True
        raise
    finally:
        with lock:
            running = False
        timer.cancel()
        if armed and not landed:
            _absorb()


def _absorb() -> None:
    """Let an `Expired` that was armed for this thread but has not landed yet land here,
    and drop it: CPython delivers it at the next loop back-edge. When nothing is pending
    (it landed and was swallowed inside the block), the loop just runs out."""
    try:
        for _ in range(1000):
            pass
    except Expired:
        pass
