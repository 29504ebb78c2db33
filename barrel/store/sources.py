"""Where a pull gets its bytes: the Ollama registry, Hugging Face, https URLs, file://.

`resolve()` turns what the user typed into a `PullPlan`: the local name to store the model
under and the blobs to fetch (with their digests and sizes when the source says them).
Network look-ups here are blocking; the pull coordinator runs them in its worker thread.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barrel.errors import BarrelError, InvalidRequest, NotFound
from barrel.store import manifests as mt
from barrel.store.download import DownloadError, open_url
from barrel.store.names import DEFAULT_HOST, ModelName, parse_digest
from barrel.store.netpolicy import NetPolicy

HF_HOSTS = ("hf.co", "huggingface.co")
DEFAULT_QUANT = "Q4_K_M"


@dataclass(frozen=True)
class Artifact:
    url: str
    media_type: str
    digest: str | None  # None: computed while downloading (plain URLs)
    size: int | None
    key: str  # partial-file key: the digest, or a hash of the URL


@dataclass
class PullPlan:
    name: ModelName
    artifacts: list[Artifact] = field(default_factory=list)
    local_file: Path | None = None  # file:// sources are imported, not downloaded


@dataclass(frozen=True)
class Registries:
    """Base URLs by registry host; anything not listed is reached over https (plain http
    with `insecure`), and only at public addresses unless `private_networks`
    (barrel.store.netpolicy)."""

    hosts: Mapping[str, str] = field(
        default_factory=lambda: {DEFAULT_HOST: "https://registry.ollama.ai"}
    )
    huggingface: str = "https://huggingface.co"
    private_networks: bool = False
    insecure: bool = False

    def base(self, host: str) -> str:
        scheme = "http" if self.insecure else "https"
        return self.hosts.get(host, f"{scheme}://{host}").rstrip("/")

    @property
    def policy(self) -> NetPolicy:
        return NetPolicy.trusting(
            [*self.hosts.values(), self.huggingface],
            private_networks=self.private_networks,
            insecure=self.insecure,
        )


def _url_key(url: str) -> str:
    import hashlib

    return hashlib.sha256(url.encode()).hexdigest()[:32]


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9._-]+", "-", text).strip("-._")[:80]
    return slug or "model"


def check_source(text: str, import_dir: Path) -> None:
    """The checks that need no network, done before a pull starts (400 on failure)."""
    text = text.strip()
    if text.startswith("file://"):
        _file(text, import_dir)
    elif text.startswith(("https://", "http://")):
        _url(text)
    elif text.startswith("hf://"):
        parts = text.removeprefix("hf://").split("/", 2)
        if len(parts) != 3 or not parts[2].endswith(".gguf"):
            raise InvalidRequest(f"{text}: expected hf://<org>/<repo>/<file>.gguf")
    elif text.split("/", 1)[0].lower() in HF_HOSTS:
        path, _, quant = text.partition(":")
        parts = path.split("/")
        if len(parts) != 3:
            raise InvalidRequest(f"{text}: expected hf.co/<org>/<repo>[:<quant>]")
        ModelName.parse(f"hf.co/{parts[1]}/{parts[2]}:{quant or 'latest'}")
    else:
        ModelName.parse(text)


def resolve(text: str, registries: Registries, import_dir: Path) -> PullPlan:
    text = text.strip()
    if text.startswith("file://"):
        return _file(text, import_dir)
    if text.startswith(("https://", "http://")):
        return _url(text)
    if text.startswith("hf://"):
        return _hf_file(text.removeprefix("hf://"), registries)
    first = text.split("/", 1)[0].lower()
    if first in HF_HOSTS:
        return _hf_repo(text, registries)
    return _ollama(ModelName.parse(text), registries)


def _file(text: str, import_dir: Path) -> PullPlan:
    path = Path(urllib.parse.unquote(urllib.parse.urlparse(text).path)).resolve()
    if not path.is_relative_to(import_dir):
        raise InvalidRequest(f"{text}: file pulls must come from the import directory {import_dir}")
    if not path.is_file():
        raise NotFound(f"{text}: no such file")
    name = ModelName.parse(f"local/file/{_slug(path.stem)}:latest")
    return PullPlan(name, local_file=path)


def _url(text: str) -> PullPlan:
    parsed = urllib.parse.urlparse(text)
    if not parsed.netloc or not parsed.path.endswith(".gguf"):
        raise InvalidRequest(f"{text}: a URL pull must name a .gguf file")
    stem = Path(urllib.parse.unquote(parsed.path)).stem
    name = ModelName.parse(f"{parsed.netloc}/url/{_slug(stem)}:latest")
    return PullPlan(name, [Artifact(text, mt.MODEL, None, None, _url_key(text))])


def _json(url: str, registries: Registries) -> Any:
    with open_url(url, {"Accept": "application/json"}, policy=registries.policy) as resp:  # type: ignore[attr-defined]
        return json.loads(resp.read(16 << 20))


def _hf_tree(repo: str, registries: Registries) -> list[dict[str, Any]]:
    url = f"{registries.huggingface.rstrip('/')}/api/models/{repo}/tree/main"
    try:
        files = _json(url, registries)
    except DownloadError as exc:
        raise NotFound(f"hf.co/{repo}: {exc.message}") from None
    if not isinstance(files, list):
        raise DownloadError(f"{url}: unexpected answer")
    return [f for f in files if isinstance(f, dict) and str(f.get("path", "")).endswith(".gguf")]


def _is_projector(entry: dict[str, Any]) -> bool:
    """Hugging Face repositories ship a projector (images, audio) beside the model as
    mmproj-*.gguf."""
    return "mmproj" in Path(str(entry["path"])).name.lower()


def _hf_artifact(
    repo: str, entry: dict[str, Any], registries: Registries, media_type: str = mt.MODEL
) -> Artifact:
    path = str(entry["path"])
    url = f"{registries.huggingface.rstrip('/')}/{repo}/resolve/main/{urllib.parse.quote(path)}"
    lfs = entry.get("lfs") or {}
    digest = f"sha256:{lfs['oid']}" if "oid" in lfs else None
    if digest is not None:
        parse_digest(digest)
    size = lfs.get("size", entry.get("size"))
    return Artifact(
        url, media_type, digest, int(size) if size is not None else None, digest or _url_key(url)
    )


def _hf_repo(text: str, registries: Registries) -> PullPlan:
    """hf.co/org/repo[:quant]: the repository's GGUF file for that quantisation."""
    path, _, quant = text.partition(":")
    parts = path.split("/")
    if len(parts) != 3:
        raise InvalidRequest(f"{text}: expected hf.co/<org>/<repo>[:<quant>]")
    repo = f"{parts[1]}/{parts[2]}"
    name = ModelName.parse(f"hf.co/{repo}:{quant or 'latest'}")
    tree = _hf_tree(repo, registries)
    files = [f for f in tree if not _is_projector(f)]
    projectors = sorted((f for f in tree if _is_projector(f)), key=_projector_rank)
    if not files:
        raise NotFound(f"hf.co/{repo} has no GGUF file")
    wanted = (quant or DEFAULT_QUANT).lower()
    matches = [f for f in files if wanted in str(f["path"]).lower()]
    if not matches and not quant and len(files) == 1:
        matches = files
    if not matches:
        choices = ", ".join(str(f["path"]) for f in files)
        raise NotFound(f"hf.co/{repo} has no {wanted} GGUF file (it has: {choices})")
    # split files (-00001-of-0000N) are not supported: take the single-file match
    chosen = sorted(matches, key=lambda f: str(f["path"]))[0]
    artifacts = [_hf_artifact(repo, chosen, registries)]
    if projectors:  # the model reads images or audio: its projector comes with it
        artifacts.append(_hf_artifact(repo, projectors[0], registries, mt.PROJECTOR))
    return PullPlan(name, artifacts)


def _projector_rank(entry: dict[str, Any]) -> tuple[int, str]:
    """f16 first (the usual published precision), then by name."""
    name = str(entry["path"]).lower()
    return (0 if "f16" in name else 1, name)


def _hf_file(text: str, registries: Registries) -> PullPlan:
    """hf://org/repo/file.gguf: one named file."""
    parts = text.split("/", 2)
    if len(parts) != 3 or not parts[2].endswith(".gguf"):
        raise InvalidRequest(f"hf://{text}: expected hf://<org>/<repo>/<file>.gguf")
    repo, file = f"{parts[0]}/{parts[1]}", parts[2]
    entry = next((f for f in _hf_tree(repo, registries) if f["path"] == file), None)
    if entry is None:
        raise NotFound(f"hf://{text}: no such file")
    name = ModelName.parse(f"hf.co/{repo}:{_slug(Path(file).stem)}")
    return PullPlan(name, [_hf_artifact(repo, entry, registries)])


def _ollama(name: ModelName, registries: Registries) -> PullPlan:
    base = registries.base(name.host)
    url = f"{base}/v2/{name.namespace}/{name.model}/manifests/{name.tag}"
    try:
        with open_url(url, {"Accept": mt.MANIFEST_V2}, policy=registries.policy) as resp:  # type: ignore[attr-defined]
            manifest = mt._decoder.decode(resp.read(1 << 20))
    except DownloadError as exc:
        if exc.http_status == 404:
            raise NotFound(f"model {str(name)!r} not found in {base}") from None
        raise
    except BarrelError:
        raise  # refused by the network policy
    except Exception as exc:  # noqa: BLE001 - a registry answer is untrusted input
        raise DownloadError(f"{url}: bad manifest: {exc}") from None
    blobs = f"{base}/v2/{name.namespace}/{name.model}/blobs/"
    layers = [manifest.config, *manifest.layers]
    return PullPlan(
        name,
        [Artifact(blobs + la.digest, la.mediaType, la.digest, la.size, la.digest) for la in layers],
    )
