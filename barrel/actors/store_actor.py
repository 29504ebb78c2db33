"""The store actor: every change to manifests goes through its one thread.

Reads and writes of `barrel.store.store.ModelStore` are blocking file I/O; running them
here keeps them off the event loop and serialises creates, copies, deletes, edits and
prunes (pulls write their own manifests atomically, and prune leaves their downloads
alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from barrel.actors.child import Child, Link
from barrel.store.modelfile import Modelfile
from barrel.store.store import ModelRecord, ModelStore


class StoreActor(Child):
    def __init__(self, link: Link, store: ModelStore) -> None:
        super().__init__(link)
        self.store = store

    def list_models(self) -> list[ModelRecord]:
        return self.store.list_models()

    def get(self, name: str) -> ModelRecord:
        return self.store.get(name)

    def create(self, name: str, spec: Modelfile, files: dict[str, str] | None) -> str:
        return self.store.create(name, spec, files)

    def copy(self, source: str, destination: str) -> None:
        self.store.copy(source, destination)

    def delete(self, name: str) -> None:
        self.store.delete(name)

    def edit(self, name: str, parameters: dict[str, Any]) -> str:
        return self.store.edit(name, parameters)

    def prune(self) -> tuple[list[str], list[Path]]:
        return self.store.prune()

    def has_blob(self, digest: str) -> bool:
        return self.store.blobs.has(digest)
