"""KV bookkeeping for the engine: which tokens each sequence holds, and a byte-bounded
cache of sequence states evicted from the context (RAM, spilling to an optional disk
directory). Used from the engine thread only."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


def common_prefix(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: conversations share long prefixes.
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


Logits = tuple[tuple[int, ...], np.ndarray]  # a prompt, and the logits its prefill left


@dataclass
class Slot:
    """One llama.cpp sequence id and what its KV cells hold."""

    seq: int
    tokens: list[int] = field(default_factory=list)  # positions 0..len-1 are in the KV
    session: str | None = None
    # whose tokens these are (an API key's hash; "" without keys): reuse stays within it
    scope: str = ""
    last_used: float = 0.0
    busy: bool = False  # a request runs on it
    pinned: bool = False  # holds a pinned prefix: copied from, never run on
    # The logits that followed the last prompt prefilled here, with that prompt: the
    # same prompt asked again samples its first token from them instead of decoding its
    # last token alone (which rounds differently from the batch it was first part of).
    prompt_logits: Logits | None = None

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class SavedState:
    tokens: tuple[int, ...]
    session: str | None
    data: bytes | None  # None: spilled to disk
    path: Path | None = None
    scope: str = ""
    logits: Logits | None = None  # the slot's `prompt_logits` (in RAM only)

    @property
    def size(self) -> int:
        if self.data is None:
            return 0
        return len(self.data) + (self.logits[1].nbytes if self.logits is not None else 0)


class StateCache:
    """LRU of evicted sequence states, bounded in bytes; evictions spill to `disk_dir`
    (also bounded) when one is set."""

    def __init__(self, ram_bytes: int, disk_dir: Path | None = None, disk_bytes: int = 0) -> None:
        self.ram_bytes = ram_bytes
        self.disk_dir = disk_dir
        self.disk_bytes = disk_bytes
        self._ram: OrderedDict[str, SavedState] = OrderedDict()
        self._disk: OrderedDict[str, SavedState] = OrderedDict()
        self._ram_used = 0
        self._disk_used = 0
        if disk_dir is not None:
            disk_dir.mkdir(parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0

    def __len__(self) -> int:
        return len(self._ram) + len(self._disk)

    def put(
        self,
        tokens: list[int],
        session: str | None,
        data: bytes,
        scope: str = "",
        logits: Logits | None = None,
    ) -> None:
        """Keep a sequence's state (and the logits its last prompt left, so that the same
        prompt asked again after a restore decodes nothing either)."""
        if not self.enabled or len(data) > self.ram_bytes:
            return
        key = hashlib.sha1(repr((scope, tokens)).encode()).hexdigest()
        self._drop(key)
        st = SavedState(tuple(tokens), session, data, scope=scope, logits=logits)
        self._ram[key] = st
        self._ram_used += st.size
        while self._ram_used > self.ram_bytes:
            old_key, old = self._ram.popitem(last=False)
            self._ram_used -= old.size
            self._spill(old_key, old)

    def best(
        self, prompt: list[int], min_len: int, scope: str = ""
    ) -> tuple[str, SavedState, int] | None:
        """The saved state of `scope` sharing the longest prefix with `prompt`, if longer
        than `min_len` tokens."""
        found: tuple[str, SavedState, int] | None = None
        for store in (self._ram, self._disk):
            for key, st in store.items():
                if st.scope != scope:
                    continue
                n = common_prefix(st.tokens, prompt)
                if n > min_len and (found is None or n > found[2]):
                    found = (key, st, n)
        return found

    def take(self, key: str) -> bytes | None:
        """Remove an entry and return its bytes (read back from disk if spilled)."""
        st = self._ram.pop(key, None)
        if st is not None:
            self._ram_used -= st.size
            return st.data
        st = self._disk.pop(key, None)
        if st is None or st.path is None:
            return None
        try:
            data = st.path.read_bytes()
            self._disk_used -= st.path.stat().st_size
            st.path.unlink()
            return data
        except OSError:
            logger.warning("state cache file %s is gone", st.path)
            return None

    def entries(self) -> list[tuple[str, tuple[int, ...], bytes]]:
        """Every entry as (scope, tokens, state), read back from disk if spilled."""
        out = [(st.scope, st.tokens, st.data) for st in self._ram.values() if st.data is not None]
        for st in self._disk.values():
            if st.path is not None:
                try:
                    out.append((st.scope, st.tokens, st.path.read_bytes()))
                except OSError:
                    pass
        return out

    def _drop(self, key: str) -> None:
        st = self._ram.pop(key, None)
        if st is not None:
            self._ram_used -= st.size

    def _spill(self, key: str, st: SavedState) -> None:
        if self.disk_dir is None or st.data is None or len(st.data) > self.disk_bytes:
            return
        path = self.disk_dir / f"{key}.state"
        try:
            path.write_bytes(st.data)
        except OSError as exc:
            logger.warning("cannot spill a sequence state to %s: %s", path, exc)
            return
        self._disk[key] = SavedState(st.tokens, st.session, None, path, st.scope)
        self._disk_used += len(st.data)
        while self._disk_used > self.disk_bytes and self._disk:
            _, old = self._disk.popitem(last=False)
            if old.path is not None:
                try:
                    self._disk_used -= old.path.stat().st_size
                    old.path.unlink()
                except OSError:
                    pass
