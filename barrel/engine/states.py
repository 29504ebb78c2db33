"""The engine's saved sequence states, in RAM and on disk, behind one `best` / `take` /
`save`.

    RAM   barrel.engine.kvcache.StateCache: states pushed out of the context, bounded
    disk  barrel.engine.kvdisk.ModelStates: states an earlier engine of this model left

A disk state is read and checked off the engine thread: `ready` (the engine thread,
before a request takes a sequence) starts the read of a disk state longer than anything
in RAM or in the context, and answers False until its bytes are in hand; the reader
thread then wakes the engine, which admits the request and restores them (`best` finds
them, `take` hands them over). Meanwhile the other sequences keep decoding. A file that
does not check out is removed by the read and the request goes on without it.

Thread rules: `ready`, `best`, `take`, `save`, `refused` and `entries` run on the engine
thread; `_read` on a reader thread of its own (at most one read at a time, a thread
per read); the two share `_fetched` and `_reading` under `_lock`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from barrel.engine.kvcache import Logits, StateCache, common_prefix
from barrel.engine.kvdisk import ModelStates, Saved, StateFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A saved state sharing `n` tokens with a prompt: in RAM (`key` of the state cache)
    or read from disk (`file`)."""

    tokens: tuple[int, ...]
    n: int
    key: str = ""
    file: StateFile | None = None
    logits: Logits | None = None


class SavedStates:
    """Owns the RAM cache, the model's view of the disk and the disk state being read."""

    def __init__(
        self, cache: StateCache, disk: ModelStates | None, wake: Callable[[], None]
    ) -> None:
        self.cache = cache
        self.disk = disk
        self._wake = wake
        self._lock = threading.Lock()
        self._reading: str | None = None  # the key of the disk state being read
        self._fetched: tuple[StateFile, bytes] | None = None  # read, not yet taken
        self._failed: set[str] = set()  # keys whose read failed: never read again

    @property
    def can_save(self) -> bool:
        """A sequence pushed out of the context can be kept (the RAM cache is on)."""
        return self.cache.enabled

    @property
    def reading(self) -> bool:
        """A disk state is being read for a waiting request."""
        with self._lock:
            return self._reading is not None

    def save(
        self,
        tokens: list[int],
        session: str | None,
        data: bytes,
        scope: str,
        logits: Logits | None,
    ) -> bool:
        """Keep a sequence's state in RAM; False if it is larger than the cache."""
        if not self.cache.enabled or len(data) > self.cache.ram_bytes:
            return False
        self.cache.put(tokens, session, data, scope, logits)
        return True

    def ready(self, prompt: list[int], scope: str, held: int) -> bool:
        """Whether a request for `prompt` may take a sequence now: False while the disk
        state that holds more of it than `held` (the context's longest prefix) and than
        the RAM cache is being read; such a read is started here."""
        if self.disk is None:
            return True
        ram = self.cache.best(prompt, held, scope) if self.cache.enabled else None
        on_disk = self.disk.best(prompt, scope, max(held, ram[2] if ram else 0))
        if on_disk is None:
            return True
        entry = on_disk[0]
        with self._lock:
            if entry.key in self._failed:
                return True
            if self._fetched is not None and self._fetched[0].key == entry.key:
                return True
            if self._reading is not None:
                return False
            self._reading = entry.key
        threading.Thread(
            target=self._read, args=(entry,), name=f"kv-read-{self.disk.model}", daemon=True
        ).start()
        return False

    def _read(self, entry: StateFile) -> None:
        """Reader thread: the file's bytes, checked (a bad file is removed: None)."""
        assert self.disk is not None
        data: bytes | None = None
        try:
            data = self.disk.disk.read(entry)
        except Exception:  # a saved state never takes the engine down
            logger.exception("reading a saved state of %s failed", self.disk.model)
        with self._lock:
            self._reading = None
            self._fetched = (entry, data) if data is not None else None
            if data is None:
                self._failed.add(entry.key)
        self._wake()

    def best(self, prompt: list[int], keep: int, scope: str) -> Found | None:
        """The longest state of `prompt` in `scope` past `keep` tokens whose bytes are at
        hand: the disk state read for it, else the RAM cache's."""
        ram = self.cache.best(prompt, keep, scope) if self.cache.enabled else None
        found = None
        if ram is not None:
            key, saved, n = ram
            found = Found(saved.tokens, n, key=key, logits=saved.logits)
        with self._lock:
            fetched = self._fetched
        if fetched is not None and fetched[0].scope == scope:
            tokens = fetched[0].tokens.tolist()
            n = common_prefix(tokens, prompt)
            if n > max(keep, found.n if found else 0):
                found = Found(tuple(tokens), n, file=fetched[0])
        return found

    def take(self, found: Found) -> bytes | None:
        """The bytes of `found`, which leaves RAM (a disk state stays on disk)."""
        if found.file is None:
            return self.cache.take(found.key)
        with self._lock:
            fetched, self._fetched = self._fetched, None
        if fetched is None or fetched[0].key != found.file.key:
            return None
        return fetched[1]

    def restored(self, found: Found, prompt: list[int]) -> None:
        """`found` is in a sequence now (a disk restore is counted)."""
        if found.file is not None and self.disk is not None:
            self.disk.disk.restored(self.disk.model, min(found.n, len(prompt) - 1))

    def refused(self, found: Found) -> None:
        """llama.cpp refused `found`'s bytes: a disk state (another model's, another
        layout) is removed; a RAM one is gone already."""
        if found.file is None or self.disk is None:
            logger.warning("restoring a cached sequence state failed; recomputing")
            return
        key = found.file.key
        logger.warning("a saved state of %s does not fit the context: removed", self.disk.model)
        self.disk.disk.remove_where(lambda e: e.key != key)

    def entries(self) -> list[Saved]:
        """The RAM cache's states, to write to disk as the engine stops."""
        return [Saved(scope, tokens, data) for scope, tokens, data in self.cache.entries()]

    def __len__(self) -> int:
        return len(self.cache)
