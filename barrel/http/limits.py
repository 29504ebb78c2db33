"""How deep a raw body nests, read before any parser sees it (the other limits of a
request are the pipeline's: barrel.pipeline.generation.check)."""

from __future__ import annotations

import re

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"{}[]")


def json_depth(raw: bytes) -> int:
    """How deep `raw` nests objects and arrays (strings left out), without parsing it:
    a deep body would exhaust a parser's recursion."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        if b in b"{[":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest
