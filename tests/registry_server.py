"""Real HTTP servers on 127.0.0.1 speaking the Ollama registry protocol, Hugging Face's
file API and plain file downloads, for pull tests. Runs its own event loop in a thread,
so a daemon in a subprocess can reach it too."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

PIECE = 64 * 1024


@dataclass
class Served:
    path: str
    start: int
    sent: int = 0


@dataclass
class RegistryServer:
    root: Path
    blobs: dict[str, Path] = field(default_factory=dict)
    manifests: dict[str, bytes] = field(default_factory=dict)
    hf_trees: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    hf_files: dict[str, Path] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    # Throttle: past this many bytes of a response, send PIECE bytes every `slow_delay`.
    slow_after: int | None = None
    slow_delay: float = 0.05
    port: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("registry server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- content ------------------------------------------------------------------

    def blob(self, data_or_path: bytes | Path) -> tuple[str, int]:
        data = data_or_path.read_bytes() if isinstance(data_or_path, Path) else data_or_path
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self.root / digest.replace(":", "-")
        path.write_bytes(data)
        self.blobs[digest] = path
        return digest, len(data)

    def add_ollama_model(
        self,
        repo: str,
        tag: str,
        gguf: Path,
        template: str | None = None,
        params: dict[str, Any] | None = None,
        system: str | None = None,
        projector: Path | None = None,
    ) -> str:
        def layer(media: str, data: bytes | Path) -> dict[str, Any]:
            digest, size = self.blob(data)
            return {"mediaType": media, "digest": digest, "size": size}

        layers = [layer("application/vnd.ollama.image.model", gguf)]
        if template is not None:
            layers.append(layer("application/vnd.ollama.image.template", template.encode()))
        if params is not None:
            layers.append(layer("application/vnd.ollama.image.params", json.dumps(params).encode()))
        if system is not None:
            layers.append(layer("application/vnd.ollama.image.system", system.encode()))
        if projector is not None:
            layers.append(layer("application/vnd.ollama.image.projector", projector))
        config = layer("application/vnd.docker.container.image.v1+json", b'{"model_format":"gguf"}')
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": config,
            "layers": layers,
        }
        self.manifests[f"{repo}:{tag}"] = json.dumps(manifest).encode()
        return layers[0]["digest"]

    def add_hf_file(self, repo: str, filename: str, path: Path) -> str:
        data = path.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        self.hf_trees.setdefault(repo, []).append(
            {
                "type": "file",
                "path": filename,
                "size": len(data),
                "lfs": {"oid": sha, "size": len(data)},
            }
        )
        self.hf_files[f"{repo}/{filename}"] = path
        return "sha256:" + sha

    def bytes_served(self, suffix: str) -> list[Served]:
        return [s for s in self.served if s.path.endswith(suffix)]

    # -- server -------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v2/_catalog", self._catalog)
        app.router.add_get("/v2/{ns}/{model}/manifests/{tag}", self._manifest)
        app.router.add_get("/v2/{ns}/{model}/blobs/{digest}", self._blob)
        app.router.add_get("/api/models/{org}/{repo}/tree/main", self._hf_tree)
        app.router.add_get("/{org}/{repo}/resolve/main/{file}", self._hf_file)
        app.router.add_get("/files/{name}", self._file)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _catalog(self, _request: web.Request) -> web.Response:
        repos = sorted({key.rsplit(":", 1)[0] for key in self.manifests})
        return web.json_response({"repositories": repos})

    async def _manifest(self, request: web.Request) -> web.Response:
        m = request.match_info
        key = f"{m['ns']}/{m['model']}:{m['tag']}"
        if key not in self.manifests:
            return web.json_response({"errors": [{"code": "MANIFEST_UNKNOWN"}]}, status=404)
        return web.Response(
            body=self.manifests[key],
            content_type="application/vnd.docker.distribution.manifest.v2+json",
        )

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        path = self.blobs.get(request.match_info["digest"])
        if path is None:
            return web.Response(status=404)
        return await self._send(request, path)

    async def _hf_tree(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        if repo not in self.hf_trees:
            return web.json_response({"error": "Repository not found"}, status=404)
        return web.json_response(self.hf_trees[repo])

    async def _hf_file(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        path = self.hf_files.get(f"{m['org']}/{m['repo']}/{m['file']}")
        if path is None:
            return web.Response(status=404)
        return await self._send(request, path)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        path = self.files.get(request.match_info["name"])
        if path is None:
            return web.Response(status=404)
        return await self._send(request, path)

    async def _send(self, request: web.Request, path: Path) -> web.StreamResponse:
        """Serve a file with Range support, in pieces, optionally throttled."""
        size = path.stat().st_size  # noqa: ASYNC240 - a test server; stat is instant
        start = 0
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
        record = Served(request.path, start)
        self.served.append(record)
        status = 206 if start else 200
        headers = {"Content-Length": str(size - start), "Accept-Ranges": "bytes"}
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        with path.open("rb") as f:
            f.seek(start)
            while piece := f.read(PIECE):
                if self.slow_after is not None and record.sent >= self.slow_after:
                    await asyncio.sleep(self.slow_delay)
                await resp.write(piece)
                record.sent += len(piece)
        await resp.write_eof()
        return resp
