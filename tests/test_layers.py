"""The house rules of guides/architecture.md, read from the source: which layer may
import which, and no reaching into pykka's private parts."""

from __future__ import annotations

import ast
from pathlib import Path

import pykka

import barrel

ROOT = Path(barrel.__file__).parent

# package -> the barrel packages it must not import (at any depth, in any function)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "http": ("barrel.engine", "barrel.store"),
    "actors": ("barrel.http", "barrel.cli", "barrel.daemon", "barrel.services"),
    "pipeline": ("barrel.http", "barrel.actors", "barrel.cli", "barrel.daemon"),
    "engine": ("barrel.http", "barrel.actors", "barrel.pipeline", "barrel.store", "barrel.cli"),
    "store": ("barrel.http", "barrel.actors", "barrel.pipeline", "barrel.engine", "barrel.cli"),
    # The CLI talks to the daemon over HTTP; it reads a GGUF header (serve's --model
    # check) and parses a Modelfile (create) itself, as Ollama's CLI does.
    "cli": ("barrel.http", "barrel.actors", "barrel.engine", "barrel.pipeline"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, with its line (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_each_layer_imports_only_what_lies_below_it() -> None:
    offenders = []
    for package, forbidden in FORBIDDEN.items():
        for path in _files(package):
            for line, name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    offenders.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert offenders == []


def test_the_rule_reader_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The reader above is not blind: an import inside a function, a from-import and a
    relative import are all seen."""
    fake = ROOT / "http" / "_probe_for_layers_test.py"
    fake.write_text(
        "def f():\n    from barrel.engine import engine\n"
        "from ..store import store\nimport barrel.engine.model\n"
    )
    try:
        names = [name for _, name in _imports(fake)]
    finally:
        fake.unlink()
    assert "barrel.engine" in names
    assert "barrel.store.store" in names
    assert "barrel.engine.model" in names


def test_no_module_uses_pykka_private_names_or_overrides_its_private_methods() -> None:
    private_methods = {
        name
        for name in dir(pykka.ThreadingActor)
        if name.startswith("_") and not name.endswith("__")
    }
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT.parent)
        for line, name in _imports(path):
            if name.startswith("pykka.") and any(p.startswith("_") for p in name.split(".")[1:]):
                offenders.append(f"{where}:{line} imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                value = node.value
                if isinstance(value, ast.Name) and value.id == "pykka":
                    offenders.append(f"{where}:{node.lineno} uses pykka.{node.attr}")
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in private_methods:
                        offenders.append(f"{where}:{item.lineno} overrides {item.name}")
    assert offenders == []
