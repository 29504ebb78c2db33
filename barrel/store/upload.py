"""A blob upload in progress: a temp file in the blob directory, hashed as it is
written, moved into place only if it matches the expected digest. Blocking calls: the
HTTP handler runs them in a worker thread."""

from __future__ import annotations

import hashlib
import os
import time

from barrel.store.blobs import BlobStore, DigestMismatch, fsync_dir
from barrel.store.names import parse_digest


class BlobUpload:
    def __init__(self, blobs: BlobStore) -> None:
        self.blobs = blobs
        self.path = blobs.dir / f".upload-{os.getpid()}-{time.monotonic_ns()}.tmp"
        self._file = self.path.open("wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def commit(self, expected: str) -> str:
        """Move into place; a digest mismatch deletes the upload (400)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        actual = self._hash.hexdigest()
        if parse_digest(expected) != actual:
            raise DigestMismatch(f"uploaded data has digest sha256:{actual}, not {expected}")
        self.path.replace(self.blobs.path(expected))
        fsync_dir(self.blobs.dir)
        return expected

    def discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)
