"""The C heap under the daemon (glibc's malloc), kept flat across model loads.

glibc gives each thread that allocates an arena of its own, up to eight per core, and
keeps freed pages until it happens to trim them. A model load runs in new threads (its
actor's, its engine's), so each reload left a fresh arena a few MB of pages that freed
chunks never gave back (about 2.4 MB a load with the tiny model: the daemon crept by
that much every load/unload cycle), and an unloaded model's buffers stayed resident
until malloc trimmed them by chance (the +50 MB after the first reload). And glibc
raises its mmap threshold each time a mapped block is freed (up to 32 MB), after which
blocks of that size come from an arena's heap instead: the unloaded daemon kept ~5 MB
more, once, from the second, third or fourth Qwen cycle on, in two runs of three (in
none of seven with the threshold fixed). Two arenas and a fixed threshold
for the whole daemon, set before its threads start, and a trim after every unload
keep the resident size flat (tests/test_reload_memory.py; guides/operations.md).

With MALLOC_ARENA_MAX or MALLOC_MMAP_THRESHOLD_ in the environment glibc's own
setting stands; elsewhere than glibc these calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import time

logger = logging.getLogger(__name__)

ARENAS = 2
# Blocks this large or larger are mapped and unmapped on their own; smaller ones (the
# sampler's arrays of a vocabulary's size, 0.6 MB of floats on Qwen, every token) stay in
# the heap.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameters (malloc.h)
_M_ARENA_MAX = -8


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None  # not glibc
    return libc


_LIBC = _libc()


_collect = False  # set by tune(): `barrel serve`, not a test that runs the app in-process


def tune(arenas: int = ARENAS, mmap_threshold: int = MMAP_THRESHOLD) -> dict[str, bool]:
    """The daemon's process: at most `arenas` malloc arenas and a fixed mmap threshold
    from now on (call before threads start), and a collection in every `trim`; which
    malloc settings took, by glibc's environment variable."""
    global _collect
    _collect = True
    wanted = {
        "MALLOC_ARENA_MAX": (_M_ARENA_MAX, arenas),
        "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, mmap_threshold),
    }
    return {
        name: _LIBC is not None and name not in os.environ and bool(_LIBC.mallopt(*setting))
        for name, setting in wanted.items()
    }


def trim() -> float:
    """After an unload: collect the cyclic garbage (in a `tune`d process), then give the
    pages malloc holds free back to the system; the seconds the collection took. An
    engine's rooms reference each other (bound methods handed between them), so without
    the collection a stopped engine and what it held waited for the collector's next
    full pass: the unloaded daemon grew ~0.7 MB a load/unload cycle until then, and kept
    the pages after. ~30 ms in a daemon; far more in a test process holding every SDK,
    which is why only `tune` turns it on."""
    started = time.perf_counter()
    if _collect:
        gc.collect()
    took = time.perf_counter() - started
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return took
