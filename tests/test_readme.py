"""The README is the product's front page: its endpoint table renders whole and names
every route openapi.yaml documents, and every guide is listed."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _tables(text: str) -> list[list[str]]:
    """Each Markdown table: its consecutive lines that start with a pipe."""
    tables: list[list[str]] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def _cells(row: str) -> int:
    """The number of cells of a table row (pipes inside backticks do not count)."""
    return len(re.sub(r"`[^`]*`", "``", row).strip().strip("|").split("|"))


def test_every_table_is_whole() -> None:
    """A table broken by a blank line renders its second half as raw pipes: each table
    starts with a header and its separator, and every row has the header's cells."""
    tables = _tables(README)
    assert tables
    for table in tables:
        assert len(table) > 2, table
        assert set(table[1]) <= set("|-: "), table[:2]
        assert {_cells(row) for row in table} == {_cells(table[0])}, table


def test_the_table_reader_sees_a_broken_table() -> None:
    broken = "| a | b |\n| --- | --- |\n| x | y |\n\n| z | w |\n"
    tables = _tables(broken)
    assert len(tables) == 2
    assert not (len(tables[1]) > 2 and set(tables[1][1]) <= set("|-: "))
    assert _cells("| `a|b` | c |") == 2
    assert _cells("| a | b | c |") == 3


def test_every_documented_route_is_in_the_endpoint_table() -> None:
    spec = yaml.safe_load((ROOT / "openapi.yaml").read_text(encoding="utf-8"))
    table = "\n".join(t for t in _tables(README) for t in t)
    named = set(re.findall(r"(/[A-Za-z0-9_/{}.:-]*)", table))
    missing = [path for path in spec["paths"] if path not in named]
    assert len(spec["paths"]) >= 39
    assert missing == []


def test_every_guide_is_listed() -> None:
    guides = sorted(p.name for p in (ROOT / "guides").glob("*.md"))
    assert "architecture.md" in guides
    assert [g for g in guides if f"(guides/{g})" not in README] == []
