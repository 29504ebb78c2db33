"""JSON schema to GBNF, through llama-cpp-python's converter.

The converter shipped with llama-cpp-python 0.3.36 lets a JSON string contain raw control
characters (`char ::= [^"\\\\]`), so a constrained model can emit a newline inside a
string and the document no longer parses. llama.cpp's own converter excludes them; the
rule is tightened here to match it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import json_schema_to_gbnf

from barrel.errors import InvalidRequest

_LOOSE_CHAR = 'char ::= [^"\\\\]'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A GBNF grammar (root rule `root`) accepting exactly the JSON documents that
    validate against `schema`."""
    grammar: str = json_schema_to_gbnf(json.dumps(schema))
    if _LOOSE_CHAR not in grammar and "char ::=" in grammar:
        raise RuntimeError("llama-cpp-python's JSON grammar changed; review json_schema_grammar")
    return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)


# Schema keywords whose value a grammar expands into that many repetitions.
_COUNT_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
)
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# A counted group that can match in several ways (it may be empty, or hold choices or
# repetitions) multiplies llama.cpp's grammar stacks: (a?){64} costs 0.3 s a token,
# (a?){128} 4 s, (a?){200} minutes. Such a group may repeat at most this often.
AMBIGUOUS_REPEAT = 16


def check_schema(schema: Any, *, max_bytes: int, max_repeat: int, where: str) -> None:
    """Refuse (400) a JSON schema whose grammar would be too large or too slow to
    sample: its size, counted repetitions in patterns, and length or item bounds."""
    size = len(json.dumps(schema))
    if size > max_bytes:
        raise InvalidRequest(f"{where}: the schema has {size} bytes; at most {max_bytes}")

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    _check_pattern(value, max_repeat, where)
                elif key in _COUNT_KEYWORDS and isinstance(value, int) and value > max_repeat:
                    raise InvalidRequest(f"{where}: {key} {value} is above {max_repeat}")
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)


def _check_pattern(pattern: str, max_repeat: int, where: str) -> None:
    opened: list[int] = []
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":  # an escaped character: literal
            i += 2
            continue
        if ch == "[":  # a character class: its parentheses are literal
            end = pattern.find("]", i + 2)
            i = len(pattern) if end < 0 else end + 1
            continue
        if ch == "(":
            opened.append(i)
        elif ch == ")" and opened:
            start = opened.pop()
            m = _QUANTIFIER.match(pattern, i + 1)
            body = pattern[start + 1 : i]
            if m is not None and _bound(m) > AMBIGUOUS_REPEAT and any(c in body for c in "?*+|{("):
                raise InvalidRequest(
                    f"{where}: the pattern repeats a group that can match in several ways "
                    f"{_bound(m)} times; at most {AMBIGUOUS_REPEAT}"
                )
        i += 1
    for m in _QUANTIFIER.finditer(pattern):
        if _bound(m) > max_repeat:
            raise InvalidRequest(
                f"{where}: the pattern repeats {_bound(m)} times; at most {max_repeat}"
            )


def _bound(m: re.Match[str]) -> int:
    return max(int(m.group(1)), int(m.group(2) or 0))
