"""The catalog: which models the daemon knows by name.

Holds the local GGUF files registered at boot (`--model NAME=PATH` and
`models.local` in the config). Runs in its own actor thread; answers are immutable.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from barrel.actors.child import Child, Link
from barrel.errors import NotFound
from barrel.store.gguf_meta import projector_reads, read_gguf
from barrel.store.local import LocalModel, check_gguf_file
from barrel.store.store import config_for

logger = logging.getLogger(__name__)


class Catalog(Child):
    def __init__(
        self, link: Link, local: Mapping[str, str], projectors: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(link)
        self._paths = dict(local)
        self._projectors = dict(projectors or {})
        self._models: dict[str, LocalModel] = {}
        self._configs: dict[str, dict[str, Any]] = {}

    def init(self) -> None:
        # Re-checked on every (re)start: a file may have gone away since boot.
        for name, path in self._paths.items():
            model = check_gguf_file(name, path)
            projector = self._projectors.get(name)
            if projector is not None:
                checked = check_gguf_file(name, projector)
                model = dataclasses.replace(model, projector=checked.path)
            self._models[name] = model
            logger.info("registered model %s -> %s", name, self._models[name].path)

    def describe(self, name: str) -> dict[str, Any]:
        """The model's config (as the store keeps for pulled models), read from the GGUF
        header the first time it is asked for."""
        model = self.lookup(name)
        if model.name not in self._configs:
            config = config_for(read_gguf(model.path))
            if model.projector is not None:
                caps = config["barrel"]["capabilities"]
                caps += [c for c in projector_reads(model.projector) if c not in caps]
            self._configs[model.name] = config
        return self._configs[model.name]

    def list_models(self) -> list[LocalModel]:
        return sorted(self._models.values(), key=lambda m: m.name)

    def lookup(self, name: str) -> LocalModel:
        """A registered file by its name, also written NAME:latest."""
        model = self._models.get(name) or self._models.get(name.removesuffix(":latest"))
        if model is None:
            raise NotFound(f"model {name!r} not found")
        return model
