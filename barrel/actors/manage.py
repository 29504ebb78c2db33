"""Model management behind the facade: list, show, create, copy, delete, edit, prune,
blobs, pulls and search. HTTP hands it checked request structs and gets plain data back;
the store is reached through its actor (one thread writes manifests) and slow work —
hashing an import, receiving a blob, asking registries — runs in worker threads, never
inside an actor that requests pass through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barrel.actors import bridge
from barrel.actors.catalog import Catalog
from barrel.actors.pulls import PullCoordinator, pull_name
from barrel.actors.registry import Registry
from barrel.actors.store_actor import StoreActor
from barrel.actors.supervisor import Supervisor
from barrel.actors.tree import CATALOG, PULL_SUP
from barrel.actors.tree import STORE as STORE_ACTOR
from barrel.background import in_background
from barrel.config import Config
from barrel.engine.kvdisk import KVDisk
from barrel.errors import BarrelError, Conflict, InvalidRequest, NotFound, Unavailable
from barrel.futures import ToLoop
from barrel.store import modelfile as mf
from barrel.store.download import open_url
from barrel.store.manifests import MODEL as MODEL_LAYER
from barrel.store.names import ModelName, parse_digest
from barrel.store.sources import check_source
from barrel.store.store import ModelRecord, ModelStore, details_of, modified_iso
from barrel.store.upload import BlobUpload

logger = logging.getLogger(__name__)

STORE_TIMEOUT = 30.0
PULL_ASK_TIMEOUT = 2.0
# The manifest commit of a create: the blob is already hashed and in place; what is left
# is reading the GGUF header and writing small layers.
CREATE_TIMEOUT = 120.0


@dataclass(frozen=True)
class NewModel:
    """A model to create: a Modelfile's text, its fields given one by one (they win over
    the text's), and files to import (name -> blob digest)."""

    name: str
    modelfile: str = ""
    from_: str = ""
    files: dict[str, str] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()  # blob digests
    template: str | None = None
    system: str | None = None
    license: tuple[str, ...] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)


@dataclass(frozen=True)
class ModelEntry:
    """One servable model, whatever it comes from (a --model file or the store)."""

    name: str
    modified_at: float
    size: int
    digest: str  # 64 hex, or "" for a local file
    details: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.name,
            "modified_at": modified_iso(self.modified_at),
            "size": self.size,
            "digest": self.digest,
            "details": self.details,
        }


def _entry(rec: ModelRecord) -> ModelEntry:
    return ModelEntry(
        str(rec.name),
        rec.modified_at,
        rec.size,
        rec.digest.removeprefix("sha256:"),
        rec.details(),
    )


class ModelManager:
    def __init__(
        self, config: Config, registry: Registry, store: ModelStore, kv_disk: KVDisk | None = None
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.kv_disk = kv_disk  # conversations saved on disk (barrel.engine.kvdisk)

    def _store_actor(self) -> Any:
        return self.registry.get(STORE_ACTOR)

    def _catalog(self) -> Any:
        return self.registry.get(CATALOG)

    def model_name(self, text: str) -> str:
        """Resolve an alias, then check the name grammar (400 on a bad name)."""
        resolved = self.config.resolve_alias(text)
        if "://" in resolved or resolved.split("/", 1)[0].lower() in ("hf.co", "huggingface.co"):
            return resolved
        return str(ModelName.parse(resolved))

    # -- listing ----------------------------------------------------------------------

    async def local_models(self) -> list[ModelEntry]:
        """Files registered with --model NAME=PATH."""
        catalog = self._catalog()
        out = []
        for local in await bridge.call(catalog, Catalog.list_models):
            config = await bridge.call(catalog, Catalog.describe, local.name, timeout=STORE_TIMEOUT)
            mtime = (await asyncio.to_thread(local.path.stat)).st_mtime
            out.append(ModelEntry(local.name, mtime, local.size, local.digest, details_of(config)))
        return out

    async def store_models(self) -> list[ModelEntry]:
        records = await bridge.call(
            self._store_actor(), StoreActor.list_models, timeout=STORE_TIMEOUT
        )
        return [_entry(r) for r in records]

    async def all_models(self) -> list[ModelEntry]:
        return [*(await self.local_models()), *(await self.store_models())]

    async def find(self, name: str) -> ModelEntry:
        """A model by any name that reaches it: a --model file's (NAME:latest too), or
        what the store resolves (a default tag, a full path)."""
        try:
            local = await bridge.call(self._catalog(), Catalog.lookup, name)
        except NotFound:
            rec = await bridge.call(
                self._store_actor(), StoreActor.get, name, timeout=STORE_TIMEOUT
            )
            return _entry(rec)
        config = await bridge.call(self._catalog(), Catalog.describe, local.name)
        mtime = (await asyncio.to_thread(local.path.stat)).st_mtime
        return ModelEntry(local.name, mtime, local.size, local.digest, details_of(config))

    async def show(self, text: str) -> dict[str, Any]:
        """/api/show's answer for a local file or a store model."""
        catalog = self._catalog()
        resolved = self.config.resolve_alias(text)
        try:
            local = await bridge.call(catalog, Catalog.lookup, resolved)
        except NotFound:
            return await self._show_stored(self.model_name(text))
        config = await bridge.call(catalog, Catalog.describe, resolved, timeout=STORE_TIMEOUT)
        meta = config["barrel"]
        return {
            "modelfile": f"# Modelfile generated by Barrel\nFROM {local.path}\n",
            "parameters": "",
            "template": meta.get("chat_templates", {}).get("", ""),
            "details": details_of(config),
            "model_info": meta.get("model_info", {}),
            "capabilities": meta.get("capabilities", []),
        }

    async def _show_stored(self, name: str) -> dict[str, Any]:
        rec: ModelRecord = await bridge.call(self._store_actor(), StoreActor.get, name)
        meta = rec.meta
        templates: dict[str, str] = meta.get("chat_templates", {})
        out: dict[str, Any] = {
            "modelfile": "# Modelfile generated by Barrel\n" + rec.modelfile().render(),
            "parameters": mf.render_parameters(rec.parameters),
            "template": rec.template if rec.template is not None else templates.get("", ""),
            "details": rec.details(),
            "model_info": meta.get("model_info", {}),
            "capabilities": rec.capabilities,
            "modified_at": modified_iso(rec.modified_at),
        }
        if rec.system is not None:
            out["system"] = rec.system
        if rec.license:
            out["license"] = "\n".join(rec.license)
        if rec.messages:
            out["messages"] = rec.messages
        return out

    async def search(self, query: str) -> list[dict[str, Any]]:
        query = query.lower()
        local = [
            {**e.summary(), "source": "local"}
            for e in await self.all_models()  # the --model files too
            if query in e.name.lower()
        ]
        remote = await asyncio.to_thread(_search_registries, self.config.registry.hosts, query)
        return local + remote

    # -- changes ----------------------------------------------------------------------

    def check_create(self, new: NewModel) -> tuple[str, mf.Modelfile, dict[str, str] | None]:
        """Everything about a create that can be checked at once (400s)."""
        name = self.model_name(new.name or _required())
        spec, files = _modelfile(new)
        if spec.from_ and not spec.from_.startswith("sha256"):
            spec.from_ = self.config.resolve_alias(spec.from_)
        return name, spec, files

    async def create(self, name: str, spec: mf.Modelfile, files: dict[str, str] | None) -> str:
        """Imports are hashed into blobs, and a new model file tried in a child process,
        in a background thread; the store actor only reads the header and commits the
        manifest. Returns the manifest digest. FROM a model registered with --model
        imports its file, as `copy` does."""
        if spec.from_ and not spec.from_.startswith("sha256") and not files:
            try:
                local = await bridge.call(self._catalog(), Catalog.lookup, spec.from_)
            except NotFound:
                pass
            else:
                digest = await in_background(self._import_local, local.path, name="barrel-import")
                spec = dataclasses.replace(spec, from_=digest)
        spec = await in_background(self._import_files, spec, files, name="barrel-import")
        return str(
            await bridge.call(
                self._store_actor(), StoreActor.create, name, spec, files, timeout=CREATE_TIMEOUT
            )
        )

    def _import_files(self, spec: mf.Modelfile, files: dict[str, str] | None) -> mf.Modelfile:
        """A background thread: FROM and ADAPTER paths become blob digests (the copy and
        its hash happen here, atomically, before any manifest is touched), and the model
        blob must load in a child process (barrel.store.trial)."""
        spec = dataclasses.replace(spec, adapters=list(spec.adapters))
        if spec.from_ and mf.looks_like_path(spec.from_):
            spec.from_ = self._import(spec.from_)
        spec.adapters = [a if a.startswith("sha256") else self._import(a) for a in spec.adapters]
        spec.projectors = [
            p if p.startswith("sha256") else self._import(p) for p in spec.projectors
        ]
        projectors = list(spec.projectors)
        model: str | None = None
        if files:
            ggufs = [d for f, d in files.items() if f.endswith(".gguf")] or list(files.values())
            projectors += [d for d in ggufs if self.store.is_projector(d)]
            models = [d for d in ggufs if d not in projectors]
            model = models[0] if len(models) == 1 else None
        elif spec.from_.startswith("sha256"):
            model = spec.from_
        elif projectors:
            base = self.store.get(spec.from_)
            model = next(
                (la.digest for la in base.manifest.layers if la.mediaType == MODEL_LAYER), None
            )
        if model is not None:
            self.store.check_loadable(model)
            for projector in projectors:
                self.store.check_projector(model, projector)
        return spec

    def _import(self, text: str) -> str:
        return self.store.import_file(self.store.import_path(text))

    async def copy(self, source: str, destination: str) -> None:
        """Another name for a model. A file registered with --model is copied into the
        store (hashed in a background thread), so the copy lives on its own."""
        dst = self.model_name(destination)
        try:
            local = await bridge.call(self._catalog(), Catalog.lookup, source)
        except NotFound:
            src = self.model_name(source)
            await bridge.call(self._store_actor(), StoreActor.copy, src, dst, timeout=STORE_TIMEOUT)
            return
        digest = await in_background(self._import_local, local.path, name="barrel-import")
        spec = mf.Modelfile(from_=digest)
        await bridge.call(
            self._store_actor(), StoreActor.create, dst, spec, None, timeout=CREATE_TIMEOUT
        )

    def _import_local(self, path: Path) -> str:
        digest = self.store.import_file(path)
        self.store.check_loadable(digest)
        return digest

    async def delete(self, name: str) -> None:
        """Remove a store model. A file the daemon was given (--model, [models] local)
        is not the daemon's to remove: 409, naming where it is registered."""
        try:
            local = await bridge.call(self._catalog(), Catalog.lookup, name)
        except NotFound:
            local = None
        if local is not None:
            where = (
                "the config's [models] local"
                if local.name in self.config.models.local
                else "the command line (--model)"
            )
            raise Conflict(
                f"model {local.name!r} is the file {local.path} registered on {where}; "
                "remove it there and restart the daemon"
            )
        gone = self.model_name(name)
        await bridge.call(self._store_actor(), StoreActor.delete, gone)
        if self.kv_disk is not None:
            await asyncio.to_thread(self.kv_disk.remove_where, lambda e: e.model != gone)

    async def edit(self, name: str, parameters: dict[str, Any]) -> str:
        mf.normalize_parameters({k: v for k, v in parameters.items() if v is not None})
        return str(
            await bridge.call(
                self._store_actor(), StoreActor.edit, self.model_name(name), parameters
            )
        )

    async def prune(self) -> tuple[list[str], int]:
        removed, partials = await bridge.call(
            self._store_actor(), StoreActor.prune, timeout=STORE_TIMEOUT
        )
        if self.kv_disk is not None:  # the saved conversations of models gone
            names = {m.name for m in await self.all_models()}
            await asyncio.to_thread(self.kv_disk.remove_where, lambda e: e.model in names)
        return removed, len(partials)

    # -- blobs ------------------------------------------------------------------------

    async def has_blob(self, digest: str) -> bool:
        parse_digest(digest)
        return bool(await bridge.call(self._store_actor(), StoreActor.has_blob, digest))

    async def upload_blob(self, digest: str, chunks: AsyncIterator[bytes]) -> None:
        """Write the chunks to a temp file while hashing them (off the loop), then move it
        into place if it matches `digest`. No size cap: models are large."""
        parse_digest(digest)
        upload = await asyncio.to_thread(BlobUpload, self.store.blobs)
        with self.store.writing(upload.path):
            await self._receive(upload, digest, chunks)

    async def _receive(self, upload: BlobUpload, digest: str, chunks: AsyncIterator[bytes]) -> None:
        try:
            buffer = bytearray()
            async for chunk in chunks:
                buffer += chunk
                if len(buffer) >= 1 << 20:
                    await asyncio.to_thread(upload.write, bytes(buffer))
                    buffer.clear()
            if buffer:
                await asyncio.to_thread(upload.write, bytes(buffer))
            await asyncio.to_thread(upload.commit, digest)
        finally:
            await asyncio.to_thread(upload.discard)

    # -- pulls ------------------------------------------------------------------------

    def check_pull(self, text: str) -> str:
        model = self.model_name(text)
        check_source(model, self.config.import_dir.resolve())
        return model

    @asynccontextmanager
    async def pull(
        self, model: str, insecure: bool = False
    ) -> AsyncIterator[asyncio.Queue[dict[str, Any]]]:
        """The events of `model`'s pull (joined if one runs, else started; `insecure`
        allows plain http), as they come; leaving unsubscribes (the pull goes on for its
        other subscribers)."""
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        sink = ToLoop().wrap(events.put_nowait)
        ref, token = await self._join_or_start(model, sink, insecure)
        try:
            yield events
        finally:
            if ref.is_alive():
                try:
                    await bridge.call(ref, PullCoordinator.unsubscribe, token)
                except BarrelError:
                    pass

    async def _join_or_start(self, model: str, sink: Any, insecure: bool) -> tuple[Any, int]:
        """Subscribe to the running pull of `model`, or start one subscribed from birth."""
        for _ in range(3):
            ref = self.registry.whereis(pull_name(model))
            if ref is None:
                try:
                    ref = await bridge.call(
                        self.registry.get(PULL_SUP),
                        Supervisor.start_child,
                        pull_name(model),
                        model,
                        sink,
                        insecure,
                    )
                    return ref, 0
                except InvalidRequest:
                    continue  # a concurrent request started it first: join that one
            try:
                token, history = await bridge.call(ref, PullCoordinator.subscribe, sink)
            except Unavailable:
                continue  # it finished in between: start afresh
            for event in history:
                sink(event)
            return ref, token
        raise Unavailable(f"could not start or join the pull of {model}", retry_after=1.0)

    async def pulls(self) -> list[dict[str, Any]]:
        """The pulls in progress with their latest event."""
        out = []
        for entry in self.registry.entries():
            if not entry.name.startswith("pull:"):
                continue
            ref = self.registry.whereis(entry.name)
            if ref is None:
                continue
            try:
                event = await bridge.call(ref, PullCoordinator.progress, timeout=PULL_ASK_TIMEOUT)
            except BarrelError:
                continue  # it just finished
            out.append({"model": entry.name.removeprefix("pull:"), **event})
        return out


def _required() -> str:
    raise InvalidRequest("'model' is required")


def _modelfile(new: NewModel) -> tuple[mf.Modelfile, dict[str, str] | None]:
    spec = mf.parse(new.modelfile) if new.modelfile else mf.Modelfile(from_=new.from_)
    if new.from_:
        spec.from_ = new.from_
    if new.template is not None:
        spec.template = new.template
    if new.system is not None:
        spec.system = new.system
    if new.license is not None:
        spec.license = list(new.license)
    if new.parameters:
        spec.parameters.update(mf.normalize_parameters(new.parameters))
    if new.messages:
        spec.messages = [{"role": role, "content": content} for role, content in new.messages]
    for digest in new.adapters:
        parse_digest(digest)
        spec.adapters.append(digest)
    files = dict(new.files) or None
    for digest in (files or {}).values():
        parse_digest(digest)
    if not spec.from_ and not files:
        raise InvalidRequest("one of 'from', 'files' or a Modelfile FROM line is required")
    return spec, files


def _search_registries(hosts: dict[str, str], query: str) -> list[dict[str, Any]]:
    """The registries' catalogues (`/v2/_catalog`), filtered by `query`; a registry that
    does not answer is skipped."""
    found: list[dict[str, Any]] = []
    for host, base in hosts.items():
        try:
            with open_url(f"{base.rstrip('/')}/v2/_catalog", timeout=5.0) as resp:  # type: ignore[attr-defined]
                repos = json.loads(resp.read(4 << 20)).get("repositories", [])
        except (BarrelError, ValueError, AttributeError) as exc:
            logger.info("search: registry %s did not answer: %s", host, exc)
            continue
        for repo in repos:
            if isinstance(repo, str) and query in repo.lower():
                found.append(
                    {"name": repo.removeprefix("library/"), "registry": host, "source": "registry"}
                )
    return found


__all__ = ["ModelEntry", "ModelManager", "NewModel"]
