"""KV bookkeeping for the engine: which tokens each sequence holds, and a byte-bounded
RAM cache of sequence states evicted from the context (states on disk are
barrel.engine.kvdisk's). Used from the engine thread only."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


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
    """A sequence state evicted from the context, kept in RAM."""

    tokens: tuple[int, ...]
    session: str | None
    data: bytes
    scope: str = ""
    logits: Logits | None = None  # the slot's `prompt_logits`

    @property
    def size(self) -> int:
        return len(self.data) + (self.logits[1].nbytes if self.logits is not None else 0)


class StateCache:
    """LRU of evicted sequence states, bounded in bytes; the oldest is dropped when a
    new one does not fit (its conversation is prefilled again if it comes back)."""

    def __init__(self, ram_bytes: int) -> None:
        self.ram_bytes = ram_bytes
        self._ram: OrderedDict[str, SavedState] = OrderedDict()
        self._ram_used = 0

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0

    def __len__(self) -> int:
        return len(self._ram)

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
            _, old = self._ram.popitem(last=False)
            self._ram_used -= old.size

    def best(
        self, prompt: list[int], min_len: int, scope: str = ""
    ) -> tuple[str, SavedState, int] | None:
        """The saved state of `scope` sharing the longest prefix with `prompt`, if longer
        than `min_len` tokens."""
        found: tuple[str, SavedState, int] | None = None
        for key, st in self._ram.items():
            if st.scope != scope:
                continue
            n = common_prefix(st.tokens, prompt)
            if n > min_len and (found is None or n > found[2]):
                found = (key, st, n)
        return found

    def take(self, key: str) -> bytes | None:
        """Remove an entry and return its bytes."""
        st = self._ram.pop(key, None)
        if st is None:
            return None
        self._ram_used -= st.size
        return st.data

    def entries(self) -> list[tuple[str, tuple[int, ...], bytes]]:
        """Every entry as (scope, tokens, state)."""
        return [(st.scope, st.tokens, st.data) for st in self._ram.values()]

    def _drop(self, key: str) -> None:
        st = self._ram.pop(key, None)
        if st is not None:
            self._ram_used -= st.size
