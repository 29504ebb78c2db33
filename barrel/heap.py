"""The C heap under the daemon (glibc's malloc), kept flat across model loads.

glibc gives each thread that allocates an arena of its own, up to eight per core, and
keeps freed pages until it happens to trim them. A model load runs in new threads (its
actor's, its engine's), so each reload left a fresh arena a few MB of pages that freed
chunks never gave back (about 2.4 MB a load with the tiny model: the daemon crept by
that much every load/unload cycle), and an unloaded model's buffers stayed resident
until malloc trimmed them by chance (the +50 MB after the first reload). Two arenas for
the whole daemon, set before its threads start, and a trim after every unload keep the
resident size flat (tests/test_reload_memory.py; guides/operations.md).

With MALLOC_ARENA_MAX in the environment glibc's own setting stands; elsewhere than
glibc both calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc
    return libc


_LIBC = _libc()


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas from now on (call before threads start); whether
    the setting took."""
    if _LIBC is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(_LIBC.mallopt(_M_ARENA_MAX, arenas))


def trim() -> None:
    """Give the pages malloc holds free back to the system (after an unload)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
