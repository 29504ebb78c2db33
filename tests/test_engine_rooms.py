"""The engine's rooms (barrel.engine.engine's docstring), read from the source: each
class saying what it owns, the KV cells and the sequences' token lists changed only
through the slot manager, and the rooms depending on one another in one direction,
never back on the loop. (Module length is a smell to read, not a cap: guides/
architecture.md, "Rooms".)"""

from __future__ import annotations

import ast
from pathlib import Path

import barrel.engine

ENGINE = Path(barrel.engine.__file__).parent

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


def test_every_engine_class_says_what_it_owns() -> None:
    bare = [
        f"{p.name}:{node.lineno} {node.name}"
        for p in sorted(ENGINE.glob("*.py"))
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and not ast.get_docstring(node)
    ]
    assert bare == []


# Modules that may edit a sequence's token list (`slot.tokens`), and why
TOKEN_OWNERS = {
    "slots.py": "the slot manager: the cells and the tokens they hold, in step",
    "kvcache.py": "where a Slot is defined",
}
_EDITS = {"extend", "append", "clear", "pop", "insert", "remove"}


def _token_edits(path: Path) -> list[str]:
    """Every edit of an `X.tokens` list where X names a slot: a call of an editing
    method, an assignment to it or to a part of it, a `del` of a part of it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def slot_tokens(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):
            node = node.value
        if not (isinstance(node, ast.Attribute) and node.attr == "tokens"):
            return False
        owner = node.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        return "slot" in name or name in ("src", "dst", "victim", "pin", "to")

    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _EDITS and slot_tokens(node.func.value):
                found.append(f"{path.name}:{node.lineno} {node.func.attr}")
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Delete) else [node.target]
        for target in targets:
            elts = target.elts if isinstance(target, ast.Tuple) else [target]
            found += [f"{path.name}:{node.lineno} assigns" for t in elts if slot_tokens(t)]
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def test_a_sequence_s_token_list_changes_only_in_the_slot_manager() -> None:
    edits = [
        e
        for p in sorted(ENGINE.glob("*.py"))
        if p.name not in TOKEN_OWNERS
        for e in _token_edits(p)
    ]
    assert edits == []
    assert _token_edits(ENGINE / "slots.py")  # the reader sees them where they are


def test_the_token_reader_sees_an_edit_outside_the_slot_manager(tmp_path: Path) -> None:
    probe = tmp_path / "verify.py"
    probe.write_text(
        "def f(run, t):\n    run.slot.tokens.append(t)\n    del run.slot.tokens[3:]\n"
        "    run.slot.tokens = []\n"
    )
    assert _token_edits(probe) == [
        "verify.py:2 append",
        "verify.py:3 assigns",
        "verify.py:4 assigns",
    ]


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
