"""JSON as a model writes it, a piece at a time: how far a text has got (open
containers, an open string, a member whose key has no ":" yet), where an object that
opened closes, and the one way a text cut short is completed so that it parses.

Pure functions of text; barrel.pipeline.toolcalls streams tool-call arguments with them.
"""

from __future__ import annotations

import json


class JsonScan:
    """How far a JSON text has got, scanned once from its start and then onwards: open
    containers, strings, where an object member whose key has no ":" yet begins (its
    comma, or just after its object's "{"), and where the first container that opened
    closed again."""

    def __init__(self, start: int = 0) -> None:
        self.pos = start
        self.containers: list[str] = []
        self.in_string = self.escaped = False
        self.member: int | None = None
        self.closed_at: int | None = None  # the index after it

    def copy(self) -> JsonScan:
        other = JsonScan()
        other.pos, other.containers = self.pos, list(self.containers)
        other.in_string, other.escaped, other.member = self.in_string, self.escaped, self.member
        other.closed_at = self.closed_at
        return other

    def closers(self) -> str:
        """What closes the containers still open, innermost first."""
        return "".join("}" if c == "{" else "]" for c in reversed(self.containers))

    def scan(self, text: str) -> JsonScan:
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.containers.append(ch)
                self.member = i + 1 if ch == "{" else None
            elif ch in "}]":
                if self.containers:
                    self.containers.pop()
                    if not self.containers and self.closed_at is None:
                        self.closed_at = i + 1
                self.member = None
            elif ch == ",":
                in_object = bool(self.containers) and self.containers[-1] == "{"
                self.member = i if in_object else None
            elif ch == ":":
                self.member = None
        self.pos = max(self.pos, len(text))
        return self


def object_end(text: str, start: int) -> int | None:
    """The index after the JSON object opening at `start`, None while it is not closed."""
    return JsonScan(start).scan(text).closed_at


def unfinished_key(text: str) -> int | None:
    """Where `text` (JSON cut short) ends in an object member whose key has no ":" yet,
    None if it does not."""
    return JsonScan().scan(text).member


def complete_json(text: str, keep: int = 0) -> str | None:
    """JSON cut short, with the least done that makes it parse: a member whose key has
    no ":" yet is dropped (unless it begins before `keep`, text that went out already),
    then a string is closed, a dangling ":" given null and the open brackets closed.
    None if nothing will do."""
    held = unfinished_key(text)
    if held is not None and held >= keep:
        text = text[:held]
    text = text.rstrip(" \t\r\n")
    for extra in ("", '"', " null", '": null'):
        t = text + extra
        scan = JsonScan().scan(t)
        if scan.in_string:
            continue
        candidate = t + scan.closers()
        try:
            json.loads(candidate)
        except ValueError:
            continue
        return candidate
    return None
