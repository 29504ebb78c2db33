"""A live daemon with the tiny model for hostile requests, and the check every hostile
test ends with: the daemon is alive and a normal request answers within 5 s."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from barrel.store import bundled
from barrel.store.synthetic import TinyShape, Tweak, write_small_gguf, write_tiny_gguf
from tests.daemon import Daemon, serve_models

NORMAL = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "options": {"num_predict": 4, "temperature": 0},
    "stream": False,
}


class Hostile:
    def __init__(self, daemon: Daemon, imports: Path) -> None:
        self.daemon = daemon
        self.url = daemon.url
        self.imports = imports

    def post(self, path: str, timeout: float = 600, **kw: object) -> httpx.Response:
        """A safety net sized for a loaded box: creates trial-load in a child process."""
        return httpx.post(self.url + path, timeout=timeout, **kw)  # type: ignore[arg-type]

    def still_serving(self) -> None:
        """Alive, and a normal request answers within 5 s."""
        assert self.daemon.proc.poll() is None, self.daemon.output()
        r = httpx.post(self.url + "/api/chat", json=NORMAL, timeout=5)
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True

    def gguf(self, name: str, tweak: Tweak) -> Path:
        """A tiny model with hostile metadata, in the import directory."""
        source = bundled.assemble("qwen2.5-coder-0.5b")
        return write_tiny_gguf(self.imports / name, source, TinyShape(), tweak)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[Hostile]:
    tmp = tmp_path_factory.mktemp("hostile")
    imports = tmp / "imports"
    imports.mkdir()
    shutil.copy(tiny_path, imports / "tiny.gguf")
    broken = write_small_gguf(tmp / "no-weights.gguf")  # a valid header, not a model
    d = serve_models(
        tmp,
        {"tiny": tiny_path, "broken": broken},
        f'import_dir = "{imports}"\n[limits]\ntemplate_render_s = 1.0\n',
    )
    yield Hostile(d, imports)
    d.kill()


def assert_4xx(r: httpx.Response, status: int, *words: str) -> None:
    """A clean refusal: the status, an error body, and what it says."""
    assert r.status_code == status, (r.status_code, r.text)
    text = r.text.lower()
    assert "error" in text
    for word in words:
        assert word.lower() in text, (word, r.text)
