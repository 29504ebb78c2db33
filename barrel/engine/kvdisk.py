"""Sequence states kept on disk across unloads and restarts.

When a model's engine stops for any reason but a crash, the states of its parked
sequences, pinned prefixes and state-cache entries are written here (`llama_state_seq_*`
bytes, a file each); on the next load a prompt that extends a saved prefix restores the
longest one instead of prefilling it. A state is valid only for what made its cells: the
`fingerprint` (the weights, adapters and projector, the context settings that change KV
contents, llama.cpp's version), its scope (an API key's hash: one key's tokens are never
restored for another) and its tokens.

A file is self-describing: a magic line, a JSON header (model, fingerprint, scope, token
and data sizes, a SHA-256 over the body), the tokens, the state. Files are written to a
temporary name and renamed; the index is rebuilt from the headers on first use, and a
truncated, corrupt or foreign file (or a temporary one a killed process left) is removed
then or when a restore reads it. One disk budget bounds all models together, least
recently used first.

Thread-safe: the index is guarded by a lock and file I/O happens outside it. Writes run
on the store's writer thread (`submit`), reads on a reader thread of the engine's
(barrel.engine.states), the index is built as a model loads (`load_index`): no file is
read or hashed on the event loop or in an engine's step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import llama_cpp as ll
import numpy as np

from barrel.engine.context import EngineOptions
from barrel.engine.kvcache import common_prefix

logger = logging.getLogger(__name__)

MAGIC = b"BARRELKV1\n"
SUFFIX = ".kvs"
TEMP_SUFFIX = ".tmp"
BLOCK = 256  # tokens per link of the hash chain: the granularity of a prefix lookup
MAX_HEADER = 64 * 1024
# What a stopping engine waits for its states to be written, at most.
WRITE_WAIT_S = 15.0

_LEN = struct.Struct("<I")
TOKEN = np.dtype("<i8")  # image placeholders are 63-bit (barrel.engine.projector)


def chain(tokens: np.ndarray) -> list[bytes]:
    """The hash chain over whole BLOCKs of `tokens` (int64): link i covers every token
    up to the end of block i, so two prompts share link i iff they share those tokens."""
    links: list[bytes] = []
    prev = b""
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        prev = hashlib.blake2b(prev + tokens[end - BLOCK : end].tobytes(), digest_size=16).digest()
        links.append(prev)
    return links


def fingerprint(**parts: object) -> str:
    """A digest of what makes a saved state valid (see the module's docstring)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class StateFile:
    """One saved state on disk, as the index knows it: its file, what made it (model,
    fingerprint, scope) and its tokens."""

    key: str
    path: Path
    model: str
    fingerprint: str
    blob: str  # the weights' digest or path (what `prune` checks still exists)
    scope: str
    tokens: np.ndarray  # int64
    size: int  # bytes of the file
    used: float  # last written or restored (wall clock; the LRU order)
    links: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Saved:
    """A state to write: what a stopping engine hands over."""

    scope: str
    tokens: tuple[int, ...]
    data: bytes


class KVDisk:
    """The daemon's saved sequence states, under `root`, at most `budget` bytes."""

    def __init__(
        self,
        root: Path,
        budget: int,
        on_restored: Callable[[str, int], None] | None = None,
    ) -> None:
        self.root = root
        self.budget = budget
        self.on_restored = on_restored
        self._lock = threading.Lock()
        self._entries: dict[str, StateFile] | None = None  # built on first use
        self._by_link: dict[tuple[str, str, bytes], set[str]] = {}
        self._used = 0  # bytes of the files, plus those being written
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    # -- reading -------------------------------------------------------------------

    def load_index(self) -> None:
        """Build the index from the files' headers now, on the caller's thread (a model
        being loaded), so that no engine step waits for it."""
        with self._lock:
            self._index()

    def best(
        self, fp: str, scope: str, prompt: list[int], min_len: int
    ) -> tuple[StateFile, int] | None:
        """The saved state of `fp` and `scope` sharing the longest prefix with `prompt`
        (whole chain blocks found through the index, then counted token by token), if
        longer than `min_len`."""
        tokens = np.asarray(prompt, dtype=TOKEN)
        links = chain(tokens)
        with self._lock:
            self._index()
            found: set[str] = set()
            for link in links:
                keys = self._by_link.get((fp, scope, link))
                if not keys:
                    break
                found = keys
            candidates = [self._entries[k] for k in found if self._entries and k in self._entries]
        best: tuple[StateFile, int] | None = None
        for entry in candidates:
            n = common_prefix(entry.tokens.tolist(), prompt)
            if n > min_len and (best is None or n > best[1]):
                best = (entry, n)
        return best

    def read(self, entry: StateFile) -> bytes | None:
        """The state's bytes, checked against the header's checksum; a file that does not
        check out is removed (None)."""
        try:
            with entry.path.open("rb") as f:
                header, _ = _read_header(f)
                body = f.read()
        except (OSError, ValueError) as exc:
            logger.warning("saved state %s unreadable (%s): removed", entry.path.name, exc)
            self._remove(entry.key)
            return None
        n = int(header["tokens"]) * TOKEN.itemsize
        if (
            len(body) != n + int(header["data"])
            or hashlib.sha256(body).hexdigest() != header["sha256"]
            or body[:n] != entry.tokens.tobytes()
        ):
            logger.warning("saved state %s is corrupt or truncated: removed", entry.path.name)
            self._remove(entry.key)
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path, (now, now))
        with self._lock:
            entry.used = now
        return body[n:]

    def restored(self, model: str, tokens: int) -> None:
        if self.on_restored is not None:
            self.on_restored(model, tokens)

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per model: (states, bytes) on disk."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            self._index()
            assert self._entries is not None
            for e in self._entries.values():
                count, size = out.get(e.model, (0, 0))
                out[e.model] = (count + 1, size + e.size)
        return out

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._index()
            return self._used

    # -- writing -------------------------------------------------------------------

    def submit(self, job: Callable[[], object]) -> threading.Event:
        """Run `job` on the writer thread; the event is set once it ran."""
        done = threading.Event()

        def run() -> None:
            try:
                job()
            except Exception:
                logger.exception("writing saved states failed")
            finally:
                done.set()

        with self._lock:
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(
                    target=self._write_loop, name="kv-disk", daemon=True
                )
                self._writer.start()
        self._jobs.put(run)
        return done

    def write_all(self, model: str, fp: str, blob: str, states: Iterable[Saved]) -> int:
        """Write each state (longest first, so one that only repeats another's prefix
        is not written); returns how many were written."""
        written = 0
        for st in sorted(states, key=lambda s: -len(s.tokens)):
            written += self.write(model, fp, blob, st)
        return written

    def write(self, model: str, fp: str, blob: str, st: Saved) -> bool:
        """Write one state atomically (temp file, rename) within the budget, dropping the
        least recently used states to make room and those whose tokens it extends. False
        if it is larger than the budget, repeats a prefix of a kept state, or failed."""
        tokens = np.asarray(st.tokens, dtype=TOKEN)
        links = chain(tokens)
        if not links:
            return False  # shorter than a block: nothing a lookup would find
        body = tokens.tobytes() + st.data
        header = {
            "model": model,
            "fingerprint": fp,
            "blob": blob,
            "scope": st.scope,
            "tokens": len(tokens),
            "data": len(st.data),
            "sha256": hashlib.sha256(body).hexdigest(),
        }
        head = json.dumps(header).encode()
        size = len(MAGIC) + _LEN.size + len(head) + len(body)
        key = hashlib.sha256(f"{fp}\0{st.scope}\0".encode() + tokens.tobytes()).hexdigest()[:40]
        path = self.root / f"{key}{SUFFIX}"
        with self._lock:
            self._index()
            assert self._entries is not None
            if size > self.budget:
                return False
            for e in list(self._entries.values()):
                if e.fingerprint != fp or e.scope != st.scope or e.key == key:
                    continue
                n = common_prefix(e.tokens.tolist(), st.tokens)
                if n == len(e.tokens):
                    self._forget(e.key)  # the new state holds all of it
                elif n == len(tokens):
                    return False  # a kept state holds all of this one
            self._forget(key)
            while self._used + size > self.budget and self._entries:
                self._forget(min(self._entries.values(), key=lambda e: e.used).key)
            self._used += size  # reserved while the file is written
        tmp = self.root / f"{key}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as f:
                f.write(MAGIC + _LEN.pack(len(head)) + head)
                f.write(body)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("cannot save a sequence state to %s: %s", path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                self._used -= size
            return False
        entry = StateFile(
            key, path, model, fp, blob, st.scope, tokens, size, time.time(), tuple(links)
        )
        with self._lock:
            self._used -= size
            self._add(entry)
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until what was submitted so far is written (at most `timeout`)."""
        return self.submit(lambda: None).wait(timeout)

    # -- removing ------------------------------------------------------------------

    def remove_where(self, keep: Callable[[StateFile], bool]) -> int:
        """Remove every state `keep` says no to; returns how many."""
        with self._lock:
            self._index()
            assert self._entries is not None
            gone = [k for k, e in self._entries.items() if not keep(e)]
            for k in gone:
                self._forget(k)
        return len(gone)

    def _remove(self, key: str) -> None:
        with self._lock:
            self._forget(key)

    # -- the index (lock held) -----------------------------------------------------

    def _index(self) -> None:
        if self._entries is not None:
            return
        self._entries = {}
        try:
            files = list(self.root.iterdir())
        except OSError:
            files = []
        for path in files:
            if path.name.endswith(TEMP_SUFFIX):
                _unlink(path)  # a write a killed process left
            elif path.name.endswith(SUFFIX):
                entry = _scan(path)
                if entry is None:
                    logger.warning("saved state %s is not readable: removed", path.name)
                    _unlink(path)
                else:
                    self._add(entry)

    def _add(self, entry: StateFile) -> None:
        assert self._entries is not None
        if entry.key in self._entries:
            self._forget(entry.key, unlink=False)
        self._entries[entry.key] = entry
        self._used += entry.size
        for link in entry.links:
            self._by_link.setdefault((entry.fingerprint, entry.scope, link), set()).add(entry.key)

    def _forget(self, key: str, unlink: bool = True) -> None:
        assert self._entries is not None
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._used -= entry.size
        for link in entry.links:
            keys = self._by_link.get((entry.fingerprint, entry.scope, link))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_link[(entry.fingerprint, entry.scope, link)]
        if unlink:
            _unlink(entry.path)

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _read_header(f: BinaryIO) -> tuple[dict[str, Any], int]:
    read = f.read
    if read(len(MAGIC)) != MAGIC:
        raise ValueError("not a saved state")
    raw = read(_LEN.size)
    if len(raw) != _LEN.size:
        raise ValueError("truncated header")
    (n,) = _LEN.unpack(raw)
    if n > MAX_HEADER:
        raise ValueError("header too large")
    head = read(n)
    if len(head) != n:
        raise ValueError("truncated header")
    header = json.loads(head)
    if not isinstance(header, dict):
        raise ValueError("bad header")
    for field, kind in (("model", str), ("fingerprint", str), ("blob", str), ("scope", str)):
        if not isinstance(header.get(field), kind):
            raise ValueError(f"bad header field {field}")
    for field in ("tokens", "data"):
        if not isinstance(header.get(field), int) or header[field] < 0:
            raise ValueError(f"bad header field {field}")
    if not isinstance(header.get("sha256"), str):
        raise ValueError("bad header field sha256")
    return header, len(MAGIC) + _LEN.size + n


def _scan(path: Path) -> StateFile | None:
    """An index entry from a file's header and tokens (the state is checked on restore);
    None if the header is bad or the file's size does not match it."""
    try:
        st = path.stat()
        with path.open("rb") as f:
            header, body_at = _read_header(f)
            n = int(header["tokens"])
            raw = f.read(n * TOKEN.itemsize)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if len(raw) != n * TOKEN.itemsize or st.st_size != body_at + len(raw) + int(header["data"]):
        return None
    tokens = np.frombuffer(raw, dtype=TOKEN).copy()
    return StateFile(
        path.name[: -len(SUFFIX)],
        path,
        str(header["model"]),
        str(header["fingerprint"]),
        str(header["blob"]),
        str(header["scope"]),
        tokens,
        st.st_size,
        st.st_mtime,
        tuple(chain(tokens)),
    )


@dataclass
class ModelStates:
    """One loaded model's view of the disk: its name, fingerprint and weights."""

    disk: KVDisk
    model: str
    fingerprint: str
    blob: str

    def best(self, prompt: list[int], scope: str, min_len: int) -> tuple[StateFile, int] | None:
        return self.disk.best(self.fingerprint, scope, prompt, min_len)

    def save(self, states: list[Saved]) -> threading.Event:
        return self.disk.submit(
            lambda: self.disk.write_all(self.model, self.fingerprint, self.blob, states)
        )


@dataclass(frozen=True)
class SaveTo:
    """Where an engine saves its states: the disk, the model's name and its weights'
    digest ("" for a file outside the store: known by its path, size and time)."""

    disk: KVDisk
    model: str
    blob: str = ""


def model_states(to: SaveTo, path: Path, opts: EngineOptions, n_ctx: int) -> ModelStates:
    """The view of `to.model`, loaded from `path` with `opts`, of the saved states."""
    blob = to.blob
    if not blob:
        try:
            st = path.stat()
            blob = f"{path}:{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            blob = str(path)
    fp = fingerprint(
        version=ll.__version__,
        blob=blob,
        loras=[str(lo.path) for lo in opts.loras],
        mmproj=str(opts.mmproj or ""),
        n_ctx=n_ctx,
        kv_type=str(opts.kv_type),
        flash_attn=opts.flash_attn,
        swa_full=opts.swa_full,
        per_sequence=opts.kv_per_sequence,
    )
    return ModelStates(to.disk, to.model, fp, blob)
