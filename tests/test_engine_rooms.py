"""The engine's rooms (barrel.engine.engine's docstring), read from the source: each
module small, the KV cells changed only through the slot manager, and the rooms
depending on one another in one direction, never back on the loop."""

from __future__ import annotations

import ast
from pathlib import Path

import barrel.engine

ENGINE = Path(barrel.engine.__file__).parent

MAX_LINES = 500

# The rooms of a step, each importing only rooms listed before it
ROOMS = [
    "observer",
    "inbox",
    "shared",
    "roster",
    "lora",
    "turns",
    "deliver",
    "verify",
    "admit",
    "plan",
]

# Modules that may call llama.cpp's memory and state functions, and why
KV_OWNERS = {
    "slots.py": "the slot manager: the engine's KV cells",
    "draft.py": "the draft model's own context",
    "embed.py": "an embedding context, cleared between batches; it has no slots",
}


def _kv_calls(path: Path) -> list[str]:
    """Every use of a llama_memory_* or llama_state_* function in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if isinstance(name, str) and name.startswith(("llama_memory_", "llama_state_")):
            found.append(f"{path.name}:{getattr(node, 'lineno', 0)} {name}")
    return found


def _engine_imports(path: Path) -> set[str]:
    """The barrel.engine modules `path` imports (short names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if module.startswith("barrel.engine."):
            out.add(module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[2] for a in node.names if a.name.startswith("barrel.engine.")}
    return out


def test_no_engine_module_is_over_500_lines() -> None:
    long = {
        p.name: n
        for p in ENGINE.glob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_kv_cells_change_only_through_the_slot_manager() -> None:
    calls = [
        c for p in sorted(ENGINE.glob("*.py")) if p.name not in KV_OWNERS for c in _kv_calls(p)
    ]
    assert calls == []
    assert _kv_calls(ENGINE / "slots.py")  # the reader sees them where they are


def test_the_kv_reader_sees_a_call_outside_the_slot_manager(tmp_path: Path) -> None:
    probe = tmp_path / "plan.py"
    probe.write_text(
        "import llama_cpp as ll\n\ndef f(mem):\n    ll.llama_memory_seq_rm(mem, 0, 5, -1)\n"
    )
    assert _kv_calls(probe) == ["plan.py:4 llama_memory_seq_rm"]


def test_each_room_imports_only_rooms_before_it_and_never_the_loop() -> None:
    assert all((ENGINE / f"{room}.py").is_file() for room in ROOMS)
    backwards = []
    for i, room in enumerate(ROOMS):
        for name in _engine_imports(ENGINE / f"{room}.py"):
            if name == "engine" or (name in ROOMS and ROOMS.index(name) >= i):
                backwards.append(f"{room} imports {name}")
    assert backwards == []


def test_the_loop_builds_every_room() -> None:
    assert set(ROOMS) <= _engine_imports(ENGINE / "engine.py")
