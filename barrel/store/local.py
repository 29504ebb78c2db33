"""Local GGUF files registered by path (`--model NAME=PATH`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from barrel.errors import InvalidRequest

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    mtime_ns: int = 0
    projector: Path | None = None  # a multimodal projector GGUF (--mmproj)

    @property
    def digest(self) -> str:
        """A stable 64-hex id, as a store model's manifest digest is: of the file's path,
        size and modification time (hashing gigabytes at boot would delay the start)."""
        key = f"{self.path}\0{self.size}\0{self.mtime_ns}".encode()
        return hashlib.sha256(key).hexdigest()


def check_gguf_file(name: str, path: str | Path) -> LocalModel:
    """Check that `path` is a readable file that starts with the GGUF magic.

    Only the magic is read here; the full header is parsed by the store's GGUF reader.
    """
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        st = p.stat()
        size = st.st_size
    except OSError as exc:
        raise InvalidRequest(f"model {name}: cannot read {p}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise InvalidRequest(f"model {name}: {p} is not a GGUF file")
    return LocalModel(name, p.resolve(), size, st.st_mtime_ns)
