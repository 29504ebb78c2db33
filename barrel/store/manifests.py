"""Manifests under `<root>/manifests/<host>/<namespace>/<model>/<tag>`, Ollama's layout.

A manifest is the registry's image manifest: a config blob and layers, each a
content-addressed blob. Barrel's config blob carries the GGUF metadata read at pull or
create time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

from barrel.errors import NotFound
from barrel.store.blobs import write_atomic
from barrel.store.names import ModelName, parse_digest

MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG = "application/vnd.docker.container.image.v1+json"
MODEL = "application/vnd.ollama.image.model"
ADAPTER = "application/vnd.ollama.image.adapter"
PROJECTOR = "application/vnd.ollama.image.projector"
TEMPLATE = "application/vnd.ollama.image.template"
SYSTEM = "application/vnd.ollama.image.system"
PARAMS = "application/vnd.ollama.image.params"
MESSAGES = "application/vnd.ollama.image.messages"
LICENSE = "application/vnd.ollama.image.license"


class Layer(msgspec.Struct, frozen=True, omit_defaults=True):
    mediaType: str  # the wire names
    digest: str
    size: int
    from_: str = msgspec.field(default="", name="from")

    def __post_init__(self) -> None:
        parse_digest(self.digest)  # a manifest never names a path-like digest


class Manifest(msgspec.Struct, frozen=True):
    config: Layer
    layers: list[Layer]
    schemaVersion: int = 2
    mediaType: str = MANIFEST_V2

    def layer(self, media_type: str) -> Layer | None:
        return next((la for la in self.layers if la.mediaType == media_type), None)

    def all_of(self, media_type: str) -> list[Layer]:
        return [la for la in self.layers if la.mediaType == media_type]

    def digests(self) -> set[str]:
        return {self.config.digest, *(la.digest for la in self.layers)}


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Manifest)


class ManifestStore:
    def __init__(self, root: Path) -> None:
        self.dir = root / "manifests"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, name: ModelName) -> Path:
        # Every component matched a strict grammar (no separators, no '..').
        return self.dir.joinpath(*name.parts)

    def read(self, name: ModelName) -> tuple[Manifest, bytes, float]:
        """(manifest, its raw bytes, modification time); NotFound if absent."""
        path = self.path(name)
        try:
            raw = path.read_bytes()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            raise NotFound(f"model {str(name)!r} not found") from None
        return _decoder.decode(raw), raw, mtime

    def exists(self, name: ModelName) -> bool:
        return self.path(name).is_file()

    def write(self, name: ModelName, manifest: Manifest) -> str:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = _encoder.encode(manifest)
        write_atomic(path, raw)
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    def delete(self, name: ModelName) -> None:
        path = self.path(name)
        try:
            path.unlink()
        except FileNotFoundError:
            raise NotFound(f"model {str(name)!r} not found") from None
        parent = path.parent
        while parent != self.dir:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def names(self) -> list[ModelName]:
        out = []
        for dirpath, _dirs, files in os.walk(self.dir):
            rel = Path(dirpath).relative_to(self.dir).parts
            if len(rel) != 3:
                continue
            for tag in files:
                if tag.startswith("."):
                    continue
                try:
                    out.append(ModelName.parse(f"{rel[0]}/{rel[1]}/{rel[2]}:{tag}"))
                except Exception:  # noqa: BLE001 - a stray file is not a model
                    continue
        return sorted(out)
