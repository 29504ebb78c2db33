from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import pykka
import pytest

from barrel.actors.supervisor import Supervisor
from barrel.engine.model import BATCH_INVARIANT_ENV
from barrel.store import bundled
from barrel.store.synthetic import tiny_model

# The suite compares greedy answers across batch shapes (alone, beside other streams,
# under speculation): every daemon and engine it starts, in this process or a child,
# runs batch-invariant kernels. tests/test_kernels.py starts one with llama.cpp's.
os.environ[BATCH_INVARIANT_ENV] = "1"


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int, int]]]:
    """Every batch the engine hands `llama_decode` (in this process), as its rows: (sequence, token,
    position) each."""
    steps: list[list[tuple[int, int, int]]] = []
    decode = ll.llama_decode

    def recorded(ctx: object, batch: ll.llama_batch) -> int:
        rows = range(batch.n_tokens)
        steps.append([(batch.seq_id[i][0], batch.token[i], batch.pos[i]) for i in rows])
        return decode(ctx, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(ll, "llama_decode", recorded)
    return steps


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    """Every test leaves no actor behind. Supervisors go first, oldest (roots) first, so
    that they stop their subtrees in order instead of restarting children that
    `stop_all` would stop under them."""
    yield
    for ref in pykka.ActorRegistry.get_by_class(Supervisor):
        with contextlib.suppress(pykka.ActorDeadError, pykka.Timeout):
            ref.stop(block=True, timeout=10)
    pykka.ActorRegistry.stop_all(block=True, timeout=10)


@pytest.fixture(autouse=True)
def _isolated_user_dirs(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No test reads the developer's own config or writes to their data dir. The model
    cache stays shared (assembling real models is slow)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.delenv("BARREL_CONFIG", raising=False)
    monkeypatch.setenv(bundled.CACHE_ENV, str(bundled.cache_dir()))


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return bundled.assemble("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return bundled.assemble("gemma-3-270m")


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return tiny_model()


@pytest.fixture(scope="session")
def llama_templates() -> Path:
    """The chat templates shipped in llama-cpp-python's source distribution (the pinned
    version), extracted once into the model cache."""
    import subprocess
    import sys
    import tarfile
    import tempfile

    version = "0.3.36"
    target = bundled.cache_dir() / f"llama-cpp-templates-{version}"
    if target.is_dir() and any(target.glob("*.jinja")):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                tmp,
            ],
            check=True,
            timeout=600,
        )
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        staging = Path(tmp) / "templates"
        staging.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if "/vendor/llama.cpp/models/templates/" in member.name and member.name.endswith(
                    ".jinja"
                ):
                    member.name = Path(member.name).name
                    tar.extract(member, staging, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(target)
    return target


# Fixtures that bring a real model: a test that reaches one (directly or through its
# daemon's fixture) is `real_model`, and `make check` leaves it out.
MODEL_FIXTURES = frozenset({"qwen_path", "gemma_path"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


def pytest_report_header() -> str:
    return f"barrel model cache: {os.environ.get(bundled.CACHE_ENV) or bundled.cache_dir()}"
