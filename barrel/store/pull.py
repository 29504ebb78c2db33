"""One pull, start to finish (blocking; the pull coordinator runs it in a thread).

Progress goes out as Ollama's NDJSON objects, in order: pulling manifest, pulling
<digest> with completed/total (at most every `interval` seconds per blob), verifying
sha256 digest, writing manifest, success. The manifest is written last, only after every
blob is in place and checked: a failure at any point leaves no manifest pointing at a
missing or bad blob.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from barrel.store import manifests as mt
from barrel.store.download import fetch
from barrel.store.manifests import Layer, Manifest
from barrel.store.sources import PullPlan, Registries, resolve
from barrel.store.store import ModelStore

logger = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]


def run_pull(
    store: ModelStore,
    model: str,
    registries: Registries,
    emit: Emit,
    cancelled: threading.Event,
    interval: float = 0.25,
) -> str:
    """Pull `model`; returns the local name it was stored under."""
    emit({"status": "pulling manifest"})
    plan = resolve(model, registries, store.import_dir)
    layers: list[Layer] = []
    if plan.local_file is not None:
        layers.append(_import_file(store, plan.local_file, emit))
    for art in plan.artifacts:
        shown = art.digest or "sha256:unknown"
        if art.digest is not None and store.blobs.has(art.digest):
            size = store.blobs.size(art.digest)
            emit({"status": _pulling(shown), "digest": shown, "total": size, "completed": size})
            layers.append(Layer(art.media_type, art.digest, size))
            continue
        with store.download_slot(art.key) as partial:
            last = [0.0]

            def progress(
                done: int, total: int | None, shown: str = shown, last: list[float] = last
            ) -> None:
                now = time.monotonic()
                if now - last[0] >= interval or (total is not None and done >= total):
                    last[0] = now
                    event: dict[str, Any] = {"status": _pulling(shown), "digest": shown}
                    if total is not None:
                        event["total"] = total
                    event["completed"] = done
                    emit(event)

            digest, size = fetch(
                art.url,
                partial,
                digest=art.digest,
                size=art.size,
                progress=progress,
                cancelled=cancelled,
                policy=registries.policy,
            )
            emit({"status": "verifying sha256 digest"})
            store.blobs.commit(partial, digest)
        layers.append(Layer(art.media_type, digest, size))
    manifest = _local_manifest(store, plan, layers)
    emit({"status": "writing manifest"})
    store.manifests.write(plan.name, manifest)
    emit({"status": "success"})
    return str(plan.name)


def _pulling(digest: str) -> str:
    """A layer's progress status as Ollama words it (its CLI builds progress lines from
    it): the first 12 hex digits; the `digest` field has the whole digest."""
    return f"pulling {digest.removeprefix('sha256:')[:12]}"


def _import_file(store: ModelStore, path: Path, emit: Emit) -> Layer:
    total = path.stat().st_size
    emit({"status": "pulling file", "total": total, "completed": 0})
    digest = store.import_file(path)
    emit({"status": _pulling(digest), "digest": digest, "total": total, "completed": total})
    emit({"status": "verifying sha256 digest"})
    return Layer(mt.MODEL, digest, total)


def _local_manifest(store: ModelStore, plan: PullPlan, layers: list[Layer]) -> Manifest:
    """Keep the source's layers, but the config blob is Barrel's: the GGUF metadata
    read from the model blob (a malformed file fails the pull here, with no manifest)."""
    model = next((la for la in layers if la.mediaType == mt.MODEL), None)
    if model is None:
        raise ValueError(f"{plan.name}: the source has no model layer")
    _, config = store.model_layer(model.digest)
    store.check_loadable(model.digest)
    for layer in layers:
        if layer.mediaType == mt.PROJECTOR:
            store.check_projector(model.digest, layer.digest)
    return Manifest(config, [la for la in layers if la.mediaType != mt.CONFIG])
