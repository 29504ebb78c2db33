"""Request limits every generation endpoint checks before any slow work."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from barrel.errors import InvalidRequest
from barrel.http.keys import CONFIG


def check_limits(request: web.Request, messages: list[Any], tools: list[Any]) -> None:
    limits = request.app[CONFIG].limits
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are allowed")
    if len(tools) > limits.max_tools:
        raise InvalidRequest(f"at most {limits.max_tools} tools are allowed")


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
