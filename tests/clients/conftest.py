"""One live daemon for the client-library suites: the tiny model for plain chat, usage
and overflow (a 2048-token context), Qwen2.5-Coder-0.5B where a library needs a model
that follows a schema or a tool."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, serve_models

# litellm fetches its model price map from GitHub on import; the box has no internet
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ASK = [{"role": "user", "content": "Hi"}]
LONG = "word " * 3000  # past the 2048-token context


# package scope: it goes before the rest of the suite runs (a daemon holding Qwen mapped
# would show in other tests' page-cache residency figures)
@pytest.fixture(scope="package")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, qwen_path: Path
) -> Iterator[Daemon]:
    d = serve_models(tmp_path_factory.mktemp("clients"), {"tiny": tiny_path, "qwen": qwen_path})
    yield d
    d.kill()


def counted(daemon: Daemon, model: str, messages: list[dict[str, str]]) -> int:
    """The prompt's size as the daemon counts it (Anthropic's count_tokens)."""
    r = httpx.post(
        daemon.url + "/v1/messages/count_tokens",
        json={"model": model, "messages": messages},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    n = r.json()["input_tokens"]
    assert isinstance(n, int)
    return n
