"""What a request asks its output to match, as an llguidance grammar (barrel.engine.grammar
compiles and runs it): a JSON schema, any JSON object, a regular expression, one of
several strings, or a Lark grammar (llama.cpp's GBNF is converted to Lark).

Pure functions of the request. Whether llguidance can compile the result (unsupported
schema keywords, a bad regex, limits) is decided by compiling it, in the pipeline's
worker thread, before the request takes a sequence: a 400 with llguidance's reason.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from barrel.errors import InvalidRequest
from barrel.pipeline.request import Format

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON written one way, as Python's json.dumps writes it: ", " between items, ": " after
# keys, no other whitespace. Every brace, separator and key of a fixed schema is then the
# only continuation, which the engine appends without sampling (fast-forward); free
# whitespace made none of them forced and let a sampled model write blanks until
# max_tokens.
_JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The grammar of the JSON documents that validate against `schema`, objects
    closed (`closed`)."""
    try:
        text = json.dumps(closed(schema))
        return str(LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the JSON schema cannot be used: {exc}") from None


# keywords whose value maps names to schemas, and those whose value is data, not schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def closed(schema: Any, close: bool = True) -> Any:
    """`schema` with `additionalProperties: false` wherever an object lists its
    properties and says nothing of others: the model writes the properties it was
    given (llama.cpp's converter and vLLM read schemas so; a model sampling freely
    otherwise adds keys until max_tokens). The members of an `allOf` stay open (each
    names only some of the properties of one object); their union is closed."""
    if isinstance(schema, list):
        return [closed(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        else:
            out[key] = closed(value, key != "allOf")
    if not close or "additionalProperties" in out or "patternProperties" in out:
        return out
    if "properties" in out:
        out["additionalProperties"] = False
    elif isinstance(out.get("allOf"), list):
        maps = [m["properties"] for m in out["allOf"] if isinstance(m, dict)]
        names = [n for props in maps if isinstance(props, dict) for n in props]
        if names:  # the union of the members' properties, closed
            out["properties"] = {n: True for n in names}
            out["additionalProperties"] = False
    return out


def check_size(spec: Any, *, max_bytes: int, where: str) -> None:
    """Refuse (400) a schema or grammar larger than `max_bytes` as JSON. Its cost
    otherwise is llguidance's to bound (barrel.engine.grammar.limits)."""
    size = len(json.dumps(spec))
    if size > max_bytes:
        raise InvalidRequest(f"{where}: the schema has {size} bytes; at most {max_bytes}")


def call_grammar(schema: dict[str, Any], start: int, end: int, calls: int = 1) -> str:
    """A forced tool call in its family's own syntax: the start marker's token, a new
    line, the JSON call object matching `schema`, a new line, the end marker's token
    (hermes: `<tool_call>` ... `</tool_call>`); the grammar, and the answer, end there.
    `calls` > 1: up to that many calls, a new line apart, as the family writes several."""
    call = {**closed(schema), "x-guidance": _JSON_OPTIONS}
    more = f' ("\\n" one){{0,{calls - 1}}}' if calls > 1 else ""
    lark = (
        f"start: one{more}\n"
        f'one: <[{start}]> "\\n" call "\\n" <[{end}]>\n'
        f"call: %json {json.dumps(call)}\n"
    )
    return str(LLMatcher.grammar_from_lark(lark))


def format_grammar(fmt: Format) -> str | None:
    """The grammar of a response format; None for free text."""
    if fmt.kind == "json_object":
        return json_schema_grammar(ANY_OBJECT)
    if fmt.kind == "json_schema":
        assert fmt.schema is not None
        return json_schema_grammar(fmt.schema)
    if fmt.kind == "regex":
        return str(LLMatcher.grammar_from_regex(fmt.text))
    if fmt.kind == "choice":
        return str(LLMatcher.grammar_from_lark(choice_lark(fmt.choices)))
    if fmt.kind == "grammar":
        return str(LLMatcher.grammar_from_lark(lark_of(fmt.text)))
    return None


def choice_lark(choices: tuple[str, ...]) -> str:
    """A Lark grammar matching exactly one of `choices` (JSON string literals are Lark's)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def lark_of(text: str) -> str:
    """A Lark grammar as it is, or llama.cpp's GBNF (`root ::= ...`) converted to Lark."""
    try:
        return str(any_to_lark(text))
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions too
        raise InvalidRequest(f"the GBNF grammar cannot be read: {exc}", param="grammar") from None
