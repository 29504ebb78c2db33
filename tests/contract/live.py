"""The daemon the contract is checked against: the tiny model, the tiny reranker, the
tiny model hearing through the tiny audio projector, and an Ollama registry on 127.0.0.1
that holds `tiny-pulled` (what openapi.yaml's examples name), so every example is served
as documented."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from barrel.store.synthetic import tiny_audio_projector, tiny_model, tiny_reranker
from tests.daemon import Daemon, serve_models
from tests.registry_server import RegistryServer

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "openapi.yaml"
HERE = Path(__file__).resolve().parent
MAX_TOKENS = 16


@dataclass
class Live:
    daemon: Daemon
    registry: RegistryServer

    @property
    def url(self) -> str:
        return self.daemon.url


@contextmanager
def live_daemon(tmp: Path) -> Iterator[Live]:
    (tmp / "registry").mkdir(parents=True, exist_ok=True)
    registry = RegistryServer(tmp / "registry")
    registry.add_ollama_model("library/tiny-pulled", "latest", tiny_model())
    # every answer ends after 16 tokens (limits.max_tokens): the tiny model never ends
    # one itself, and a generated request with no limit would run to the end of the
    # context (~4 s of CPU each; the fuzzer sends hundreds)
    config = (
        f'projectors = {{ "tiny-audio" = "{tiny_audio_projector()}" }}\n'
        f'[registry.hosts]\n"registry.ollama.ai" = "{registry.url}"\n'
        f"[limits]\nmax_tokens = {MAX_TOKENS}\n"
    )
    # a short context (fuzzed requests that generate to its end finish soon), with room
    # for one 30-second window of audio (750 tokens)
    models = {"tiny": tiny_model(), "tiny-rerank": tiny_reranker(), "tiny-audio": tiny_model()}
    daemon = serve_models(tmp, models, config=config, context=1024)
    try:
        yield Live(daemon, registry)
    finally:
        daemon.kill()
        registry.stop()
