"""Model weights in transparent huge pages (Linux): the `huge_pages` weight residency.

A decode step reads every weight of the model once; with the weights in 4 KiB pages
(llama.cpp maps the GGUF file, and page-cache pages are always 4 KiB) each step walks
~120,000 page-table entries for a 0.5B model and misses the TLB on most of them. Read
into anonymous memory instead (llama.cpp's load mode "none") and moved into 2 MiB pages,
the same steps ran 5-13 % faster on two cores (guides/performance.md).

llama.cpp allocates and fills its weight buffers inside one call, so the buffers are
found afterwards: the anonymous mappings that appeared in /proc/self/maps during the
load. `MADV_HUGEPAGE` marks them, and `MADV_COLLAPSE` (Linux 6.1+) copies their pages
into huge pages now rather than whenever khugepaged gets to them. Collapsing ~470 MB
takes about a second of one core, so `Collapser` does it on its own thread, a slice at a
time, while the model already serves; it holds the model (`LlamaModel.retain`) so the
buffers cannot be freed under it. A failure is logged, never raised: the weights then
stay in small pages and work as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20
SLICE = 32 << 20  # collapsed per call: a stop request waits for one slice at most
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

Region = tuple[int, int]


def available(enabled: Path = THP_ENABLED) -> bool:
    """Whether this system has transparent huge pages that madvise may ask for."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        setting = enabled.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def anonymous_regions(maps: Path = Path("/proc/self/maps")) -> set[Region]:
    """(start, end) of this process's private, writable mappings with no file."""
    try:
        text = maps.read_text()
    except OSError:
        return set()
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[1].startswith("rw") and parts[1].endswith("p"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.add((start, end))
    return out


def new_regions(before: set[Region], after: set[Region], least: int = HUGE) -> list[Region]:
    """Mappings of `after` not in `before` of at least `least` bytes, in address order (a
    buffer that the kernel merged with a neighbouring mapping shows as a new, larger one:
    the neighbour is marked too, which costs nothing)."""
    return sorted(r for r in after - before if r[1] - r[0] >= least)


class Holdable(Protocol):
    def retain(self) -> bool: ...

    def release(self) -> None: ...


class Collapser:
    """Moves `regions` of `owner`'s memory into huge pages on a thread of its own.
    `start()` returns at once; `stop()` ends it after the current slice; `done` is set
    when it has finished, stopped or failed; `collapsed` counts the bytes moved."""

    def __init__(self, owner: Holdable, regions: list[Region], name: str = "") -> None:
        self.owner = owner
        self.regions = regions
        self.name = name
        self.collapsed = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hugepages-{name}", daemon=True)

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.regions)

    def start(self) -> Collapser:
        if not self.regions or not self.owner.retain():
            self.done.set()
            return self
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        errors: set[str] = set()
        try:
            for start, end in self.regions:
                if _libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
                    errors.add(f"MADV_HUGEPAGE: {os.strerror(ctypes.get_errno())}")
                    continue
                # only whole, aligned huge pages collapse: the head and tail stay small
                for at, length in slices(start, end):
                    if self._stop.is_set():
                        return
                    if _libc.madvise(at, length, MADV_COLLAPSE) == 0:
                        self.collapsed += length
                    else:  # an older kernel: khugepaged collapses the marked pages in time
                        errors.add(f"MADV_COLLAPSE: {os.strerror(ctypes.get_errno())}")
            logger.info(
                "%s: %d of %d MiB of weights moved into huge pages%s",
                *(self.name, self.collapsed >> 20, self.total >> 20),
                f" ({'; '.join(sorted(errors))})" if errors else "",
            )
        finally:
            self.owner.release()
            self.done.set()


def slices(start: int, end: int) -> list[Region]:
    """(address, length) of the huge-page-aligned parts of [start, end), SLICE at most."""
    first = -(-start // HUGE) * HUGE
    last = end // HUGE * HUGE
    return [(at, min(SLICE, last - at)) for at in range(first, last, SLICE)]
