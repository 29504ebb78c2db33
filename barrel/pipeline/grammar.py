"""JSON schema to GBNF, through llama-cpp-python's converter.

The converter shipped with llama-cpp-python 0.3.36 lets a JSON string contain raw control
characters (`char ::= [^"\\\\]`), so a constrained model can emit a newline inside a
string and the document no longer parses. llama.cpp's own converter excludes them; the
rule is tightened here to match it.
"""

from __future__ import annotations

import json
from typing import Any

from llama_cpp.llama_grammar import json_schema_to_gbnf

_LOOSE_CHAR = 'char ::= [^"\\\\]'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F]'


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A GBNF grammar (root rule `root`) accepting exactly the JSON documents that
    validate against `schema`."""
    grammar: str = json_schema_to_gbnf(json.dumps(schema))
    if _LOOSE_CHAR not in grammar and "char ::=" in grammar:
        raise RuntimeError("llama-cpp-python's JSON grammar changed; review json_schema_grammar")
    return grammar.replace(_LOOSE_CHAR, _STRICT_CHAR)
