"""The model families' ways of writing tool calls and reasoning: how a chat template is
recognised, which markers open (and close) a tool-call region, how the region's body is
written (a parser per shape, captured region -> calls), and how reasoning is marked.

A table and pure functions; barrel.pipeline.toolcalls streams generated text through
the family a template was recognised as.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Call = tuple[str, Any]  # (name, arguments object)


def new_call_id() -> str:
    """Nine alphanumerics: the shape Mistral's templates insist on, accepted by all."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


# -- body parsers: captured region -> calls (ValueError if it is not one) ------------


def _call_of(obj: Any) -> Call:
    if not isinstance(obj, dict):
        raise ValueError("a call is a JSON object")
    inner = obj.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else obj
    name = fn.get("name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(name, str) or not isinstance(args, dict):
        raise ValueError("a call needs a name and object arguments")
    return name, args


def parse_json(body: str) -> list[Call]:
    """One JSON call object, or several separated by whitespace/newlines."""
    body = body.strip()
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    fence = re.match(r"^```(?:json)?\s*(.*?)\s*```$", body, re.S)
    if fence:
        body = fence.group(1)
    while pos < len(body):
        value, end = decoder.raw_decode(body, pos)
        if isinstance(value, list):
            calls += [_call_of(v) for v in value]
        else:
            calls.append(_call_of(value))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;,":
            pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


def _coerce(value: str) -> Any:
    value = value.strip("\n")
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_xml_function(body: str) -> list[Call]:
    """qwen3-coder: <function=NAME><parameter=K>V</parameter>...</function>."""
    calls = []
    for m in re.finditer(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", body, re.S):
        params = {
            k.strip(): _coerce(v)
            for k, v in re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", m.group(2), re.S)
        }
        calls.append((m.group(1).strip(), params))
    if not calls:
        raise ValueError("no <function=...>")
    return calls


def parse_glm(body: str) -> list[Call]:
    """glm45: NAME then <arg_key>K</arg_key><arg_value>V</arg_value> pairs; with the
    markers stripped, NAME then alternating key and value lines."""
    name = body.strip().partition("\n")[0]
    name = re.split(r"<arg_key>", name)[0].strip()
    if not name or not re.match(r"^[\w.\-]+$", name):
        raise ValueError("no function name")
    pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S)
    if not pairs and "<arg_key>" not in body:
        lines = [ln for ln in body.strip().split("\n")[1:] if ln.strip()]
        if len(lines) % 2:
            raise ValueError("keys and values do not pair up")
        pairs = list(zip(lines[::2], lines[1::2], strict=True))
    return [(name, {k.strip(): _coerce(v) for k, v in pairs})]


def parse_name_args(body: str) -> list[Call]:
    """mistral-args: NAME[ARGS]{json}, repeated (marker-stripped: NAME{json})."""
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    body = body.replace("[TOOL_CALLS]", "\n")
    while True:
        m = re.compile(r"\s*([\w.\-]+)\s*(?:\[ARGS\])?\s*").match(body, pos)
        if m is None or m.end() >= len(body) or body[m.end()] != "{":
            break
        args, end = decoder.raw_decode(body, m.end())
        if not isinstance(args, dict):
            raise ValueError("arguments must be an object")
        calls.append((m.group(1), args))
        pos = end
    if not calls or body[pos:].strip():
        raise ValueError("not NAME[ARGS]{...}")
    return calls


def parse_pythonic(body: str) -> list[Call]:
    """llama-pythonic: [f(a=1, b='x'), g()] with Python or JSON literals."""
    text = body.strip().removesuffix("<|eot_id|>").strip()
    text = re.sub(
        r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", text))
    )
    tree = ast.parse(text, mode="eval").body
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args:
            raise ValueError("not a call with keyword arguments")
        name = ast.unparse(item.func)
        calls.append((name, {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg}))
    if not calls:
        raise ValueError("no call")
    return calls


_DS = {
    "begin": "<\uff5ctool\u2581call\u2581begin\uff5c>",
    "sep": "<\uff5ctool\u2581sep\uff5c>",
    "end": "<\uff5ctool\u2581call\u2581end\uff5c>",
}


def parse_dsml(body: str) -> list[Call]:
    """DeepSeek: <|tool call begin|>function<|tool sep|>NAME, a ```json fence with the
    arguments, <|tool call end|>; or marker-stripped: functionNAME then the fence."""
    calls = []
    text = body.replace(_DS["begin"], "\n").replace(_DS["end"], "\n").replace(_DS["sep"], "")
    for m in re.finditer(r"\s*(?:function)?([\w.\-]+)\s*\n```(?:json)?\s*(.*?)\s*```", text, re.S):
        args = json.loads(m.group(2))
        if not isinstance(args, dict):
            raise ValueError("arguments must be an object")
        calls.append((m.group(1), args))
    if not calls:
        raise ValueError("no DeepSeek call")
    return calls


def parse_harmony(body: str) -> list[Call]:
    """gpt-oss: [commentary ]to=functions.NAME [<|constrain|>json]<|message|>ARGS[<|call|>]."""
    m = re.search(
        r"to=functions\.([\w.\-]+).*?(?:<\|message\|>|\bjson\b)\s*(\{.*\})\s*(?:<\|call\|>)?\s*$",
        body,
        re.S,
    )
    if m is None:
        raise ValueError("no harmony call")
    args = json.loads(m.group(2))
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return [(m.group(1), args)]


BODY_PARSERS: dict[str, Callable[[str], list[Call]]] = {
    "json": parse_json,
    "xml_function": parse_xml_function,
    "glm": parse_glm,
    "name_args": parse_name_args,
    "pythonic": parse_pythonic,
    "dsml": parse_dsml,
    "harmony": parse_harmony,
}


@dataclass(frozen=True)
class Family:
    name: str
    detect: tuple[str, ...]  # the chat template contains all of these
    starts: tuple[str, ...]  # a tool-call region opens with one of these
    end: str | None  # ... and closes with this (None: at the end of the output)
    body: str  # key of BODY_PARSERS
    stripped: tuple[str, ...] = ()  # how a region starts once control tokens vanished
    reasoning: tuple[str, str] = ("<think>", "</think>")
    excludes: tuple[str, ...] = field(default=())  # the template contains none of these
    keep_start: bool = False  # the start marker is part of the body (pythonic, harmony)
    stripped_names: bool = False  # a marker-stripped call starts with a tool's name
    noise: tuple[str, ...] = ()  # structural markers removed from content

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker string the parser reads: their control tokens must be kept."""
        harmony = ("<|channel|>", "<|message|>", "<|constrain|>", "<|call|>")
        extra = harmony if self.body == "harmony" else ()
        end = (self.end,) if self.end else ()
        return (*self.starts, *end, *self.reasoning, *self.noise, *extra)


_DS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"

# First match wins: the more specific families come first.
FAMILIES: tuple[Family, ...] = (
    Family(
        "harmony",
        detect=("<|channel|>", "<|message|>"),
        starts=("<|channel|>commentary to=functions.", "commentary to=functions.", "to=functions."),
        end=None,
        body="harmony",
        reasoning=("<|channel|>analysis<|message|>", "<|end|>"),
        keep_start=True,
        noise=("<|start|>assistant", "<|channel|>final<|message|>", "<|end|>", "<|return|>"),
    ),
    Family(
        "qwen3-coder",
        detect=("<function=", "<parameter="),
        starts=("<tool_call>", "<function="),
        end="</tool_call>",
        body="xml_function",
        stripped=("<function=",),
    ),
    Family(
        "glm45",
        detect=("<tool_call>", "<arg_key>"),
        starts=("<tool_call>",),
        end="</tool_call>",
        body="glm",
        stripped_names=True,
    ),
    Family("dsml", (_DS_BEGIN,), (_DS_BEGIN,), _DS_END, "dsml", stripped=("function",)),
    Family(
        "mistral-args",
        detect=("[TOOL_CALLS]", "[ARGS]"),
        starts=("[TOOL_CALLS]",),
        end=None,
        body="name_args",
        stripped_names=True,
    ),
    Family("mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]",), None, "json", stripped=("[{", "```")),
    Family(
        "phi4-functools",
        detect=("functools[", "<|tool|>"),
        starts=("functools",),
        end=None,
        body="json",
    ),
    Family("firefunction", ("functools[",), ("functools",), None, "json"),
    Family(
        "llama-python-tag",
        detect=("<|python_tag|>",),
        starts=("<|python_tag|>",),
        end=None,
        body="json",
        stripped=('{"name"', '{"type"', "```"),
    ),
    Family(
        "llama-pythonic",
        detect=("<|eot_id|>", "[func_name1("),
        starts=("[",),
        end=None,
        body="pythonic",
        keep_start=True,
    ),
    Family(
        "hermes",
        detect=("<tool_call>",),
        starts=("<tool_call>",),
        end="</tool_call>",
        body="json",
        stripped=('{"name"', "```"),
    ),
    Family("generic", (), (), None, "json", stripped=("{", "```")),
)
_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    return _BY_NAME[name]


def detect_family(template: str) -> Family:
    for fam in FAMILIES:
        if (
            fam.detect
            and all(d in template for d in fam.detect)
            and not any(e in template for e in fam.excludes)
        ):
            return fam
    return _BY_NAME["generic"]
