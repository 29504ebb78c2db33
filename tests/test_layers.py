"""The house rules of guides/architecture.md, read from the source: which layer may
import which, and no reaching into pykka's private parts."""

from __future__ import annotations

import ast
import subprocess
import sys
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


# -- what HTTP reaches, following imports ----------------------------------------------

# HTTP reaches the engine at run time only through the facade (the actor layer), the
# generation path and the daemon's services (metrics count the engine's results).
GATEWAYS = ("barrel.actors", "barrel.pipeline.generation", "barrel.metrics", "barrel.services")


def _module_of(name: str) -> str | None:
    """The barrel module `name` is, or lies in (`pkg.mod.Attr` -> `pkg.mod`)."""
    parts = name.split(".")
    while parts and parts[0] == "barrel":
        path = ROOT.parent.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts = parts[:-1]
    return None


def _path_of(module: str) -> Path:
    path = ROOT.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _reached(start: str, gateways: tuple[str, ...]) -> dict[str, str]:
    """Every barrel module that importing `start` loads (packages' __init__ included),
    not following imports into `gateways`; each with the module that imported it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        names = [".".join(parts[:i]) for i in range(2, len(parts))]  # its packages
        names += [name for _, name in _imports(_path_of(module))]
        for name in names:
            target = _module_of(name)
            if target is None or target in seen:
                continue
            seen[target] = module
            if not any(target == g or target.startswith(g + ".") for g in gateways):
                todo.append(target)
    return seen


def _chain(seen: dict[str, str], module: str) -> str:
    out = [module]
    while seen[out[-1]]:
        out.append(seen[out[-1]])
    return " <- ".join(out)


def _reaching(package: str, forbidden: tuple[str, ...], gateways: tuple[str, ...]) -> list[str]:
    offenders = []
    for path in _files(package):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        seen = _reached(module, gateways)
        offenders += [
            _chain(seen, m) for m in seen if any(m == f or m.startswith(f + ".") for f in forbidden)
        ]
    return offenders


def test_http_reaches_the_engine_and_the_store_only_through_the_facade_and_the_path() -> None:
    assert _reaching("http", ("barrel.engine", "barrel.store"), GATEWAYS) == []


def test_the_codecs_reach_no_engine_store_or_actor_even_transitively() -> None:
    forbidden = ("barrel.engine", "barrel.store", "barrel.actors", "barrel.pipeline.generation")
    assert _reaching("http/codecs", forbidden, ()) == []


def test_the_transitive_reader_sees_an_edge_two_modules_away() -> None:
    """A codec importing a pipeline module that imports the engine is caught (the edge
    the old pipeline.types re-export was)."""
    probe = ROOT / "http" / "codecs" / "_probe_for_layers_test.py"
    probe.write_text("from barrel.pipeline import sampling\n")
    try:
        offenders = _reaching("http/codecs", ("barrel.engine",), ())
    finally:
        probe.unlink()
    assert any(o.startswith("barrel.engine") and "_probe_for_layers_test" in o for o in offenders)


def test_every_codec_imports_where_llama_cpp_cannot_be_imported() -> None:
    """The codecs and their golden suites run without llama.cpp: each codec is imported
    in a fresh interpreter where `import llama_cpp` fails, and nothing of the engine,
    the store or the actors is loaded."""
    codecs = sorted(
        ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        for p in (ROOT / "http" / "codecs").glob("*.py")
        if p.name != "__init__.py"
    )
    assert len(codecs) >= 6
    script = (
        "import sys\n"
        "sys.modules['llama_cpp'] = None  # import llama_cpp raises ImportError\n"
        "import importlib\n"
        f"for name in {codecs!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('barrel.engine', 'barrel.store',"
        " 'barrel.actors', 'llama_cpp')) and sys.modules[m] is not None)\n"
        "print(bad)\n"
        "try:\n"
        "    import llama_cpp\n"
        "except ImportError:\n"
        "    print('blocked')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "blocked"]


def test_the_pipeline_s_leaf_modules_import_nothing_of_barrel_but_its_values() -> None:
    """The codecs' leaves import nothing of Barrel but barrel.values, itself a leaf."""
    values = [name for _, name in _imports(ROOT / "values.py")]
    assert [n for n in values if n.startswith("barrel")] == []
    for leaf in ("events", "request"):
        names = [name for _, name in _imports(ROOT / "pipeline" / f"{leaf}.py")]
        barrel_names = [n for n in names if n.startswith("barrel")]
        assert all(n.startswith("barrel.values") for n in barrel_names), leaf


# -- one name per concept -----------------------------------------------------------------

# Class names defined more than once under barrel/ on purpose, each with its reason.
SHARED_CLASS_NAMES: dict[str, str] = {}


def _class_names(path: Path) -> list[tuple[str, int]]:
    """The classes `path` defines, nested ones included, with their lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(n.name, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]


def _defined_twice(root: Path) -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for name, line in _class_names(path):
            where.setdefault(name, []).append(f"{path.relative_to(root.parent)}:{line}")
    return {name: places for name, places in where.items() if len(places) > 1}


def test_no_class_name_is_defined_twice() -> None:
    """One name per concept: a second class of the same name under barrel/ is either
    the same concept written twice, or two concepts that need names saying their layer
    (guides/architecture.md, "Glossary")."""
    twice = {n: p for n, p in _defined_twice(ROOT).items() if n not in SHARED_CLASS_NAMES}
    assert twice == {}
    assert set(SHARED_CLASS_NAMES) <= set(_defined_twice(ROOT)), "a stale allow-list entry"


def test_the_class_name_reader_sees_a_second_definition(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("class Usage:\n    pass\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("def f():\n    class Usage:\n        pass\n")
    assert _defined_twice(tmp_path / "pkg") == {"Usage": ["pkg/a.py:1", "pkg/sub/b.py:2"]}
