"""Weight residency: how much of a model's memory-mapped file is in RAM, and steering it.

llama.cpp maps the GGUF file; these helpers find that mapping in /proc/self/maps and use
madvise, mlock and mincore on it (Linux). Modes (manifest field, Modelfile PARAMETER
weight_residency, config default; Modelfile over manifest over config):

- eager: MADV_WILLNEED, the kernel reads the weights ahead;
- lazy: no read-ahead, pages come in on first touch (lower RSS until used). llama.cpp
  0.3.36 always maps with MAP_POPULATE, so after the load the mapping's pages are
  released (MADV_DONTNEED, then POSIX_FADV_DONTNEED so the kernel may drop them) and the
  mapping is marked MADV_RANDOM;
- pinned: mlock the whole mapping (the load mode asks llama.cpp for it too);
- lazy_then_pin_resident: lazy at load; after the first request, lock only the pages
  that request made resident.

A failed mlock (RLIMIT_MEMLOCK, missing capability) is a logged warning, never a crash.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

MADV_RANDOM = 1
MADV_WILLNEED = 3
MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE
MODES = ("eager", "lazy", "pinned", "lazy_then_pin_resident")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def mappings(path: Path, maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
    """(start, end) of every mapping of `path` in this process."""
    target = str(path.resolve())
    out = []
    try:
        text = maps.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


def _resident_vector(start: int, end: int) -> bytes:
    pages = (end - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(start, end - start, vec) != 0:
        return b""
    return bytes(vec)


def resident_bytes(path: Path, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of this process's mappings of the model that are in its RAM: their `Rss`
    in /proc/self/smaps. Pages of the file that only another process keeps in the page
    cache do not count (mincore would count them: two daemons sharing a file, or a
    test's other daemons, would read each other's residency)."""
    target = str(path.resolve())
    total = 0
    inside = False
    try:
        with smaps.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if line[:1].isdigit() or line[:1] in "abcdef":  # a mapping's header
                    parts = line.split(maxsplit=5)
                    inside = len(parts) == 6 and parts[5].rstrip("\n") == target
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def advise(path: Path, mode: str) -> None:
    """Apply `mode` to the model's mappings right after load."""
    if mode not in MODES:
        raise ValueError(f"unknown weight_residency {mode!r}")
    found = mappings(path)
    for start, end in found:
        length = end - start
        if mode == "eager":
            _libc.madvise(start, length, MADV_WILLNEED)
        elif mode in ("lazy", "lazy_then_pin_resident"):
            _libc.madvise(start, length, MADV_RANDOM)
            _libc.madvise(start, length, MADV_DONTNEED)
        elif mode == "pinned" and _libc.mlock(start, length) != 0:
            logger.warning("mlock of %s failed: %s", path.name, os.strerror(ctypes.get_errno()))
    if found and mode in ("lazy", "lazy_then_pin_resident"):
        drop_page_cache(path)


def pin_resident(path: Path) -> int:
    """Lock the pages that are resident now (lazy_then_pin_resident); returns bytes locked."""
    locked = 0
    for start, end in mappings(path):
        vec = _resident_vector(start, end)
        run_start = None
        for i, b in enumerate([*vec, 0]):
            if b & 1 and run_start is None:
                run_start = i
            elif not b & 1 and run_start is not None:
                addr, length = start + run_start * PAGE, (i - run_start) * PAGE
                if _libc.mlock(addr, length) == 0:
                    locked += length
                else:
                    logger.warning(
                        "mlock of %s failed: %s", path.name, os.strerror(ctypes.get_errno())
                    )
                    return locked
                run_start = None
    return locked


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's clean cached pages (a cold start)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class ResidencyTracker:
    """Loaded models' files, for the resident-bytes gauge (read on every scrape, from
    the event loop; written by the engine workers). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[str, Path] = {}

    def register(self, model: str, path: Path) -> None:
        with self._lock:
            self._paths[model] = path

    def unregister(self, model: str) -> None:
        with self._lock:
            self._paths.pop(model, None)

    def resident(self) -> dict[str, int]:
        with self._lock:
            paths = dict(self._paths)
        return {model: resident_bytes(path) for model, path in paths.items()}
