"""The model store: named models over manifests and blobs. Blocking file I/O: call it
from an actor or a worker thread, never from the event loop."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barrel.errors import InvalidRequest, NotFound
from barrel.store import manifests as mt
from barrel.store.blobs import BlobStore
from barrel.store.gguf_meta import GGUFInfo, projector_reads, read_gguf
from barrel.store.manifests import Layer, Manifest, ManifestStore
from barrel.store.modelfile import (
    Modelfile,
    ModelfileError,
    looks_like_path,
    normalize_parameters,
)
from barrel.store.names import ModelName, parse_digest
from barrel.store.trial import trial_load

logger = logging.getLogger(__name__)

HEADERS_KEPT = 64  # parsed GGUF headers and imported files remembered
PULL_CONTEXT_CAP = 32768  # stored context at pull/create; max_context_size applies at load


@dataclass
class ModelRecord:
    name: ModelName
    manifest: Manifest
    digest: str  # of the manifest bytes, as Ollama reports it
    modified_at: float
    config: dict[str, Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    model_path: Path | None = None
    adapter_paths: list[Path] = field(default_factory=list)
    projector_path: Path | None = None

    @property
    def size(self) -> int:
        return sum(la.size for la in self.manifest.layers) + self.manifest.config.size

    @property
    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = self.config.get("barrel", {})
        return meta

    def details(self) -> dict[str, Any]:
        return details_of(self.config)

    def modelfile(self) -> Modelfile:
        return Modelfile(
            from_=str(self.model_path) if self.model_path else "",
            parameters=dict(self.parameters),
            system=self.system,
            template=self.template,
            license=list(self.license),
            messages=list(self.messages),
            adapters=[str(p) for p in self.adapter_paths],
            projectors=[str(self.projector_path)] if self.projector_path else [],
        )

    @property
    def capabilities(self) -> list[str]:
        caps: list[str] = list(self.meta.get("capabilities", []))
        if self.projector_path is not None:
            caps += [c for c in projector_reads(self.projector_path) if c not in caps]
        return caps


def details_of(config: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `details` of a model, from its config (the store's, or a local file's)."""
    return {
        "parent_model": config.get("parent_model", ""),
        "format": config.get("model_format", "gguf"),
        "family": config.get("model_family", ""),
        "families": config.get("model_families", []),
        "parameter_size": config.get("model_type", ""),
        "quantization_level": config.get("file_type", ""),
    }


def config_for(info: GGUFInfo, parent: str = "") -> dict[str, Any]:
    """The config blob: Ollama's fields plus the GGUF metadata Barrel uses."""
    return {
        "model_format": "gguf",
        "model_family": info.architecture,
        "model_families": [info.architecture],
        "model_type": info.size_label,
        "file_type": info.quantization,
        "parent_model": parent,
        "barrel": {
            "architecture": info.architecture,
            "parameter_count": info.parameter_count,
            "context_length": min(info.context_length or PULL_CONTEXT_CAP, PULL_CONTEXT_CAP),
            "context_length_trained": info.context_length,
            "embedding_length": info.embedding_length,
            "block_count": info.block_count,
            "head_count": info.head_count,
            "head_count_kv": info.head_count_kv,
            "tokenizer_model": info.get("tokenizer.ggml.model", ""),
            "pooling_type": info.pooling_type,
            "embedding_model": info.is_embedding_model,
            "capabilities": info.capabilities,
            "chat_templates": info.chat_templates,
            "model_info": info.model_info(),
        },
    }


class ModelStore:
    def __init__(
        self, root: Path, import_dir: Path | None = None, *, trial_load: bool = True
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(root)
        self.manifests = ManifestStore(root)
        self.import_dir = (import_dir or root / "imports").resolve()
        # Partial downloads in progress (one thread each): prune leaves them alone, and a
        # second download of the same blob waits for the first.
        self._downloads: dict[Path, threading.Lock] = {}
        self._downloads_lock = threading.Lock()
        self._writing: set[Path] = set()
        # Model blobs that a trial load in a child process accepted (barrel.store.trial).
        self._loadable: set[str] = set()
        self._loadable_pairs: set[tuple[str, str]] = set()  # (model, projector)
        self.trial_load = trial_load
        # Parsed GGUF headers by blob digest (a blob never changes): a create FROM a model
        # file reads its header in the import thread, the store actor finds it here.
        self._headers: OrderedDict[str, GGUFInfo] = OrderedDict()
        # Local files imported, by (path, inode, size, mtime): the blob each became. A
        # create FROM the same unchanged file does not read and copy it again.
        self._imported: OrderedDict[tuple[str, int, int, int], str] = OrderedDict()
        self._memo_lock = threading.Lock()

    @contextlib.contextmanager
    def download_slot(self, key: str) -> Iterator[Path]:
        partial = self.blobs.partial(key)
        with self._downloads_lock:
            lock = self._downloads.setdefault(partial, threading.Lock())
        with lock:
            try:
                yield partial
            finally:
                with self._downloads_lock:
                    self._downloads.pop(partial, None)

    @contextlib.contextmanager
    def writing(self, path: Path) -> Iterator[Path]:
        """Mark a file being written into the blob directory (an upload) as in flight:
        prune leaves it alone."""
        with self._downloads_lock:
            self._writing.add(path)
        try:
            yield path
        finally:
            with self._downloads_lock:
                self._writing.discard(path)

    def active_partials(self) -> set[Path]:
        with self._downloads_lock:
            return set(self._downloads) | self._writing

    # -- reading ------------------------------------------------------------------

    def get(self, name: ModelName | str) -> ModelRecord:
        name = ModelName.parse(name) if isinstance(name, str) else name
        manifest, raw, mtime = self.manifests.read(name)
        config = self._json_blob(manifest.config.digest, {})
        rec = ModelRecord(
            name, manifest, "sha256:" + hashlib.sha256(raw).hexdigest(), mtime, config
        )
        for layer in manifest.layers:
            kind = layer.mediaType
            if kind == mt.MODEL:
                rec.model_path = self.blobs.path(layer.digest)
            elif kind == mt.ADAPTER:
                rec.adapter_paths.append(self.blobs.path(layer.digest))
            elif kind == mt.PROJECTOR:
                rec.projector_path = self.blobs.path(layer.digest)
            elif kind == mt.PARAMS:
                rec.parameters = self._json_blob(layer.digest, {})
            elif kind == mt.TEMPLATE:
                rec.template = self._text_blob(layer.digest)
            elif kind == mt.SYSTEM:
                rec.system = self._text_blob(layer.digest)
            elif kind == mt.MESSAGES:
                rec.messages = self._json_blob(layer.digest, [])
            elif kind == mt.LICENSE:
                rec.license.append(self._text_blob(layer.digest))
        return rec

    def list_models(self) -> list[ModelRecord]:
        out = []
        for name in self.manifests.names():
            try:
                out.append(self.get(name))
            except Exception as exc:  # noqa: BLE001 - one bad manifest must not hide the rest
                logger.warning("skipping manifest %s: %s", name, exc)
        return out

    def _text_blob(self, digest: str) -> str:
        return self.blobs.path(digest).read_text(encoding="utf-8")

    def _json_blob(self, digest: str, default: Any) -> Any:
        try:
            return json.loads(self.blobs.path(digest).read_bytes())
        except FileNotFoundError:
            return default

    # -- writing ------------------------------------------------------------------

    def _json_layer(self, media_type: str, value: Any) -> Layer:
        data = json.dumps(value, sort_keys=True).encode()
        return Layer(media_type, self.blobs.put_bytes(data), len(data))

    def _text_layer(self, media_type: str, text: str) -> Layer:
        data = text.encode("utf-8")
        return Layer(media_type, self.blobs.put_bytes(data), len(data))

    def import_file(self, path: Path) -> str:
        """Copy a local file into the blob store, hashed on the way (slow: a worker
        thread). A file imported before and unchanged since (the same inode, size and
        modification time) whose blob is still stored is not read again."""
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        with self._memo_lock:
            digest = self._imported.get(key)
        if digest is not None and self.blobs.has(digest):
            return digest
        with path.open("rb") as f:
            digest = self.blobs.put_stream(iter(lambda: f.read(1 << 20), b""))
        self._remember(self._imported, key, digest)
        return digest

    def header(self, digest: str) -> GGUFInfo:
        """The GGUF header of a stored blob, parsed once (InvalidGGUF, a 400, if it is
        not one; a vocabulary takes a fifth of a second to read)."""
        with self._memo_lock:
            info = self._headers.get(digest)
            if info is not None:
                self._headers.move_to_end(digest)
                return info
        info = read_gguf(self.blobs.path(digest))
        self._remember(self._headers, digest, info)
        return info

    def _remember(self, memo: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        """Keep `value` in a memo of at most HEADERS_KEPT entries, dropping the oldest."""
        with self._memo_lock:
            memo[key] = value
            memo.move_to_end(key)
            while len(memo) > HEADERS_KEPT:
                memo.popitem(last=False)

    def model_layer(self, digest: str) -> tuple[Layer, Layer]:
        """(model layer, config layer) for a GGUF blob already in the store. A malformed
        file is refused with 400 and the blob left for prune."""
        path = self.blobs.path(digest)
        if not path.is_file():
            raise NotFound(f"blob {digest} not found; upload it first")
        info = self.header(digest)
        layer = Layer(mt.MODEL, digest, path.stat().st_size)
        return layer, self._json_layer(mt.CONFIG, config_for(info))

    def check_loadable(self, digest: str) -> None:
        """A model blob must load and run in a child process before a manifest names it
        (slow: call from a worker thread, never from the store actor)."""
        parse_digest(digest)
        if digest in self._loadable or not self.trial_load:
            return
        path = self.blobs.path(digest)
        if not path.is_file():
            raise NotFound(f"blob {digest} not found; upload it first")
        info = self.header(digest)
        trial_load(path, embedding=info.is_embedding_model)
        self._loadable.add(digest)

    def check_projector(self, model: str, projector: str) -> None:
        """A projector blob must be a clip GGUF that loads beside its model and encodes
        an image, in a child process, before a manifest names the pair (slow: a worker
        thread)."""
        parse_digest(projector)
        if not self.blobs.has(projector):
            raise NotFound(f"projector blob {projector} not found; upload it first")
        if not self.is_projector(projector):
            raise InvalidRequest(
                "a projector (a second FROM, an mmproj file) must be a multimodal projector "
                "GGUF (architecture clip)"
            )
        if (model, projector) in self._loadable_pairs or not self.trial_load:
            return
        trial_load(self.blobs.path(model), mmproj=self.blobs.path(projector))
        self._loadable_pairs.add((model, projector))

    def import_path(self, text: str) -> Path:
        """A FROM path, which must stay inside the import directory."""
        candidate = Path(text)
        if not candidate.is_absolute():
            candidate = self.import_dir / candidate
        resolved = candidate.resolve()
        if not resolved.is_relative_to(self.import_dir):
            raise InvalidRequest(
                f"FROM path {text!r} is outside the import directory {self.import_dir}"
            )
        if not resolved.is_file():
            raise InvalidRequest(f"FROM path {text!r} does not exist")
        return resolved

    def create(
        self, name: ModelName | str, spec: Modelfile, files: dict[str, str] | None = None
    ) -> str:
        """Create (or replace) `name` from a Modelfile-like spec. `files` maps file names
        to uploaded blob digests (the structured /api/create form). Returns the manifest
        digest. Nothing is written until every input checks out."""
        name = ModelName.parse(name) if isinstance(name, str) else name
        base: ModelRecord | None = None
        model: Layer | None = None
        config: Layer | None = None
        if files:
            ggufs = [d for f, d in files.items() if f.endswith(".gguf")] or list(files.values())
            projectors = [d for d in ggufs if self.is_projector(d)]
            ggufs = [d for d in ggufs if d not in projectors]
            if len(ggufs) != 1:
                raise InvalidRequest("exactly one model GGUF file is needed in 'files'")
            spec.projectors = [*projectors, *spec.projectors]
            model, config = self.model_layer(ggufs[0])
        elif spec.from_.startswith("sha256"):
            parse_digest(spec.from_)
            model, config = self.model_layer(spec.from_)
        elif looks_like_path(spec.from_):
            digest = self.import_file(self.import_path(spec.from_))
            model, config = self.model_layer(digest)
        elif spec.from_:
            base = self.get(spec.from_)
        else:
            raise ModelfileError("FROM (or files) is required")

        layers: list[Layer] = []
        if base is not None:
            inherited = {
                mt.MODEL,
                mt.ADAPTER,
                mt.PROJECTOR,
                mt.TEMPLATE,
                mt.SYSTEM,
                mt.LICENSE,
                mt.MESSAGES,
            }
            layers = [la for la in base.manifest.layers if la.mediaType in inherited]
            config = base.manifest.config
        else:
            assert model is not None
            layers = [model]
        assert config is not None
        params = dict(base.parameters) if base else {}
        params.update(normalize_parameters(spec.parameters))
        for adapter in spec.adapters:
            digest = self._blob_of(adapter, "adapter")
            layers.append(Layer(mt.ADAPTER, digest, self.blobs.size(digest)))
        if len(spec.projectors) > 1:
            raise ModelfileError("at most one projector (a second FROM) is allowed")
        for projector in spec.projectors:
            digest = self._blob_of(projector, "projector")
            info = self.header(digest)
            if info.architecture != "clip":
                raise ModelfileError(
                    f"a second FROM must be a multimodal projector GGUF (architecture "
                    f"clip), not {info.architecture or 'unknown'}"
                )
            layers[:] = [la for la in layers if la.mediaType != mt.PROJECTOR]
            layers.append(Layer(mt.PROJECTOR, digest, self.blobs.size(digest)))

        def replace(media_type: str, layer: Layer | None) -> None:
            layers[:] = [la for la in layers if la.mediaType != media_type]
            if layer is not None:
                layers.append(layer)

        if spec.template is not None:
            replace(mt.TEMPLATE, self._text_layer(mt.TEMPLATE, spec.template))
        if spec.system is not None:
            replace(mt.SYSTEM, self._text_layer(mt.SYSTEM, spec.system))
        if spec.messages:
            replace(mt.MESSAGES, self._json_layer(mt.MESSAGES, spec.messages))
        if spec.license:
            layers[:] = [la for la in layers if la.mediaType != mt.LICENSE]
            layers += [self._text_layer(mt.LICENSE, text) for text in spec.license]
        replace(mt.PARAMS, self._json_layer(mt.PARAMS, params) if params else None)
        return self.manifests.write(name, Manifest(config, layers))

    def is_projector(self, digest: str) -> bool:
        parse_digest(digest)
        if not self.blobs.has(digest):
            return False
        try:
            return self.header(digest).architecture == "clip"
        except Exception:  # noqa: BLE001 - not a GGUF: model_layer says why
            return False

    def _blob_of(self, ref: str, what: str) -> str:
        """The blob a Modelfile line names: a digest already stored, or a file imported."""
        if ref.startswith("sha256"):
            digest = ref
            parse_digest(digest)
        else:
            digest = self.import_file(self.import_path(ref))
        if not self.blobs.has(digest):
            raise NotFound(f"{what} blob {digest} not found")
        return digest

    def copy(self, source: str, destination: str) -> None:
        src, dst = ModelName.parse(source), ModelName.parse(destination)
        manifest, _, _ = self.manifests.read(src)
        self.manifests.write(dst, manifest)

    def delete(self, name: str) -> None:
        self.manifests.delete(ModelName.parse(name))

    def edit(self, name: str, parameters: dict[str, Any]) -> str:
        """Change stored parameters (e.g. num_ctx) without a new pull. A None value
        removes the parameter."""
        model = ModelName.parse(name)
        rec = self.get(model)
        params = dict(rec.parameters)
        removed = [k for k, v in parameters.items() if v is None]
        params.update(normalize_parameters({k: v for k, v in parameters.items() if v is not None}))
        for key in removed:
            params.pop(key, None)
        layers = [la for la in rec.manifest.layers if la.mediaType != mt.PARAMS]
        if params:
            layers.append(self._json_layer(mt.PARAMS, params))
        return self.manifests.write(model, Manifest(rec.manifest.config, layers))

    def prune(self, active_partials: set[Path] | None = None) -> tuple[list[str], list[Path]]:
        """Remove blobs no manifest references, and partial downloads that are not in
        progress. Returns what was removed."""
        referenced: set[str] = set()
        for name in self.manifests.names():
            try:
                manifest, _, _ = self.manifests.read(name)
            except Exception:  # noqa: BLE001 - keep going; an unreadable manifest pins nothing
                continue
            referenced |= manifest.digests()
        removed = []
        for digest in self.blobs.all_digests():
            if digest not in referenced:
                self.blobs.path(digest).unlink(missing_ok=True)
                removed.append(digest)
        active = (active_partials or set()) | self.active_partials()
        # A temporary file written to in the last minutes belongs to a writer still at it
        # (an import hashing into the store): only older ones are left over.
        fresh = time.time() - TMP_GRACE_S
        partials = [
            p
            for p in self.blobs.partials()
            if p not in active and not (p.name.endswith(".tmp") and _mtime(p) > fresh)
        ]
        for p in partials:
            p.unlink(missing_ok=True)
        return removed, partials


TMP_GRACE_S = 600.0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def modified_iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1e6):06d}Z"
