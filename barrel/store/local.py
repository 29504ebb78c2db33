"""Local GGUF files registered by path (`--model NAME=PATH`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from barrel.errors import InvalidRequest

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int


def check_gguf_file(name: str, path: str | Path) -> LocalModel:
    """Check that `path` is a readable file that starts with the GGUF magic.

    Only the magic is read here; the full header is parsed by the store's GGUF reader.
    """
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        size = p.stat().st_size
    except OSError as exc:
        raise InvalidRequest(f"model {name}: cannot read {p}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise InvalidRequest(f"model {name}: {p} is not a GGUF file")
    return LocalModel(name, p.resolve(), size)
