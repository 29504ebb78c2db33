"""Content-addressed blobs under `<root>/blobs/sha256-<hex>`, written atomically.

Partial downloads live beside them as `sha256-<hex>-partial` (or `partial-<key>` when
the digest is not known yet) so that a restarted daemon resumes them.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from barrel.errors import InvalidRequest
from barrel.store.names import parse_digest


class DigestMismatch(InvalidRequest):
    code = "digest_mismatch"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "blobs"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.dir / f"sha256-{parse_digest(digest)}"

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def partial(self, key: str) -> Path:
        """Where a download of `key` (a digest, or a hash of its URL) accumulates."""
        if key.startswith("sha256"):
            return self.dir / f"sha256-{parse_digest(key)}-partial"
        if not key.isalnum() or len(key) > 64:
            raise InvalidRequest("invalid partial key")
        return self.dir / f"partial-{key}"

    def put_bytes(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self.path(digest)
        if not path.exists():
            write_atomic(path, data)
        return digest

    def put_stream(self, chunks: Iterable[bytes], expected: str | None = None) -> str:
        """Store a blob from chunks; with `expected`, refuse it unless it matches."""
        tmp = self.dir / f".upload-{os.getpid()}-{time.monotonic_ns()}.tmp"
        h = hashlib.sha256()
        try:
            with tmp.open("wb") as f:
                for chunk in chunks:
                    h.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            digest = "sha256:" + h.hexdigest()
            if expected is not None and parse_digest(expected) != h.hexdigest():
                raise DigestMismatch(f"the data has digest {digest}, not {expected}")
            tmp.replace(self.path(digest))
            fsync_dir(self.dir)
            return digest
        finally:
            tmp.unlink(missing_ok=True)

    def commit(self, partial: Path, digest: str) -> Path:
        """Move a verified download into place."""
        path = self.path(digest)
        with partial.open("rb+") as f:
            os.fsync(f.fileno())
        partial.replace(path)
        fsync_dir(self.dir)
        return path

    def all_digests(self) -> list[str]:
        out = []
        for p in self.dir.iterdir():
            name = p.name
            if name.startswith("sha256-") and len(name) == 71:
                out.append("sha256:" + name[7:])
        return out

    def partials(self) -> list[Path]:
        return [
            p
            for p in self.dir.iterdir()
            if p.name.endswith("-partial")
            or p.name.startswith("partial-")
            or p.name.endswith(".tmp")
        ]


def hash_file(f: BinaryIO, h: hashlib._Hash | None = None) -> hashlib._Hash:
    h = h or hashlib.sha256()
    while block := f.read(1 << 20):
        h.update(block)
    return h
