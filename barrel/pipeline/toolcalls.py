"""Tool calls and reasoning in generated text: one streaming parser driven by a table of
model families.

Each family says how its chat template can be recognised, which markers open (and close)
a tool-call region, how the region's body is written, and how reasoning is marked. The
parser streams plain text out as soon as it cannot be the start of a marker, hands
reasoning out separately, and parses each tool-call region when it closes. Markers that
are control tokens vanish when a model's output is detokenized without special tokens;
every family also accepts its marker-stripped shape. Text that does not parse as a call
comes back as content: output is never dropped.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from barrel.pipeline.events import (
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)

ParseEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta | ToolCallEvent
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


class ToolCallParser:
    """Feed generated text in any chunks; get content, reasoning and tool calls out.

    `tools` names the request's tools: a parsed call to another name is not a call, and
    with no tools nothing is parsed as one (only reasoning is separated).
    """

    def __init__(self, fam: Family, tools: Iterable[str] = (), *, reasoning: bool = True) -> None:
        self.family = fam
        self.tools = set(tools)
        self.reasoning = reasoning
        self._buf = ""
        self._state = "text"  # text | reasoning | call
        self._started = False  # any non-space output seen
        self._region = ""
        self._after_reasoning = False
        # a stray closing fence may follow a bare call object ("fence": it came)
        self._after_call: bool | str = False
        self._spoke = False  # content other than whitespace went out
        # JSON-call families: a call object may appear anywhere, bare or fenced, with any
        # whitespace; such text is held until it is known to be a call or not.
        self._bare_calls = bool(self.tools) and fam.body == "json"
        # The JSON call being written, once its name is a declared tool's: (id, name,
        # where its arguments start in the region), and how much of them went out.
        self._live: tuple[str, str, int] | None = None
        self._sent = 0
        self._scan = _JsonScan()  # of what of its arguments went out

    @property
    def _markers(self) -> list[str]:
        markers = []
        if self.tools:
            markers += list(self.family.starts)
        if self.reasoning:
            markers.append(self.family.reasoning[0])
        return [m for m in markers if m]

    def feed(self, chunk: str) -> list[ParseEvent]:
        self._buf += chunk
        return self._drain(final=False)

    def finish(self) -> list[ParseEvent]:
        out = self._drain(final=True)
        if not self._started and self._buf.strip():
            # Held from the start as a possible marker-stripped call.
            calls = self._parse(self._buf) or self._parse_with("json", self._buf)
            if calls is not None:
                self._buf = ""
                return out + [_event(c) for c in calls]
            self._started = True
            out += self._drain(final=True)
        if self._state == "call":
            out += self._close_region(self._region + self._buf, final=True)
        elif self._state == "object":
            self._region += self._buf
            self._buf = ""
            out += self._object(final=True) or []
        elif self._state == "reasoning" and self._buf:
            out.append(ReasoningDelta(self._buf))
        elif self._buf:
            out.append(TextDelta(self._buf))
        self._buf = self._region = ""
        return [e for e in out if not isinstance(e, TextDelta) or e.text]

    def _drain(self, final: bool) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        while self._buf:
            if self._state == "reasoning":
                end = self.family.reasoning[1]
                at = self._buf.find(end)
                if at < 0:
                    keep = _partial_suffix(self._buf, [end])
                    if len(self._buf) > keep:
                        out.append(ReasoningDelta(self._buf[: len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep :]
                    return out
                if at:
                    out.append(ReasoningDelta(self._buf[:at]))
                self._buf = self._buf[at + len(end) :]
                self._state = "text"
                self._after_reasoning = True
                continue
            if self._state == "call":
                self._region += self._buf
                self._buf = ""
                call_end = self.family.end
                at = self._region.find(call_end) if call_end else -1
                if at < 0 or call_end is None:
                    return out + self._stream(self._region)
                region, self._buf = self._region[:at], self._region[at + len(call_end) :]
                self._region = ""
                self._state = "text"
                out += self._close_region(region, final=False)
                continue
            if self._state == "object":
                self._region += self._buf
                self._buf = ""
                decided = self._object(final=False)
                if decided is None:
                    return out + self._stream(self._region)
                out += decided
                continue
            if self._after_call:  # a stray closing fence after a bare call object
                rest = self._buf.lstrip()
                if not rest and final:
                    self._buf = ""  # only whitespace after the last call
                    return out
                if not rest or ("```".startswith(rest[:3]) and len(rest) < 3 and not final):
                    return out
                if rest.startswith("```") and self._after_call != "fence":
                    self._buf = rest[3:]
                    self._after_call = "fence"  # closed: only whitespace may follow it
                    continue
                self._after_call = False
                continue
            if self._after_reasoning:  # the newlines that follow a reasoning block
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return out
                self._after_reasoning = False
            # text: a stripped call shape at the very start is held to the end
            if not self._started:
                stripped = self._buf.lstrip()
                if not stripped:
                    return out
                shapes = list(self.family.stripped)
                if self.family.stripped_names:
                    shapes += list(self.tools)
                if self.tools and any(
                    stripped.startswith(s) or s.startswith(stripped) for s in shapes
                ):
                    head = _CALL_HEAD.match(stripped, _object_start(stripped))
                    if not (self._bare_calls and head and head.group(1) in self.tools):
                        return out  # a marker-stripped call? undecided until the output ends
                    # a call object with a declared tool's name: read (and streamed) as one
                    self._started, self._state, self._region = True, "object", ""
                    self._buf = stripped
                    continue
                self._started = True
            soft = list(_SOFT_STARTS) if self._bare_calls else []
            found = _earliest(self._buf, self._markers + list(self.family.noise) + soft)
            if found is None:
                held = list(self.family.noise) + self._markers + soft
                keep = 0 if final else _partial_suffix(self._buf, held)
                if len(self._buf) > keep:
                    said = self._buf[: len(self._buf) - keep]
                    out.append(TextDelta(said))
                    self._spoke = self._spoke or bool(said.strip())
                    self._buf = self._buf[len(self._buf) - keep :]
                return out
            at, marker = found
            if at:
                out.append(TextDelta(self._buf[:at]))
                self._spoke = self._spoke or bool(self._buf[:at].strip())
            if marker in self.family.noise and marker not in self._markers:
                self._buf = self._buf[at + len(marker) :]
                continue
            if marker in soft:
                if at and not self._spoke and not self._buf[:at].strip():
                    out.pop()  # only whitespace before a call object: not content
                self._buf = self._buf[at:]
                self._state = "object"
                self._region = ""
                continue
            self._buf = self._buf[at + len(marker) :]
            if self.reasoning and marker == self.family.reasoning[0]:
                self._state = "reasoning"
            else:
                self._state = "call"
                self._region = marker if self.family.keep_start else ""
        return out

    def _close_region(self, region: str, final: bool) -> list[ParseEvent]:
        calls = self._parse(region)
        if calls is None and final:
            partial = self._partial(region)
            calls = [partial] if partial is not None else None
        if self._live is not None:
            return self._end_live(region, calls)
        if calls is None:
            marker = (
                "" if self.family.keep_start or not self.family.starts else self.family.starts[0]
            )
            return [TextDelta(marker + region + (self.family.end or "") * (not final))]
        return [_event(c) for c in calls]

    def _object(self, final: bool) -> list[ParseEvent] | None:
        """The held region that may be a call object (bare or in a ``` fence): its events
        once decided, None while undecided."""
        region = self._region
        start = 0
        if region.startswith("```"):
            m = _FENCE_OPEN.match(region)
            if m is None:  # not a fence opener we know: plain text
                return self._as_text(region[:3], region[3:])
            if m.end() == len(region) and not final:
                return None
            if m.end() == len(region) or region[m.end()] != "{":
                return self._as_text(region[: m.end()], region[m.end() :])
            start = m.end()
        end = _object_end(region, start)
        if end is None:
            if not final and len(region) < MAX_HELD:
                return None
            partial = self._partial(region[start:]) if final else None
            self._region = ""
            self._state = "text"
            if self._live is not None:
                return self._end_live(region, [partial] if partial is not None else None)
            if partial is not None:
                return [_event(partial)]
            return [TextDelta(region)]
        calls = self._parse_with("json", region[start:end])
        if calls is None and self._live is None:
            return self._as_text(region[:1], region[1:])
        self._region = ""
        self._state = "text"
        self._buf = region[end:] + self._buf
        self._after_call = True
        if self._live is not None:
            return self._end_live(region[:end], calls)
        return [_event(c) for c in calls or []]

    def _stream(self, region: str) -> list[ParseEvent]:
        """While a JSON call is being written: once its name is a declared tool's, the
        call starts, and its arguments go out as they come, all but what may still turn
        out to close the call (trailing whitespace, one "}", the start of an end
        marker). The call is never taken back: it has a declared tool's name."""
        out: list[ParseEvent] = []
        if self._live is None:
            m = _CALL_HEAD.match(region, _object_start(region))
            if m is None or m.group(1) not in self.tools:
                return out
            self._live, self._sent, self._scan = (
                (new_call_id(), m.group(1), m.end()),
                0,
                _JsonScan(),
            )
            out.append(ToolCallStart(self._live[0], self._live[1]))
        text = region[self._live[2] :]
        ends = [e for e in (self.family.end, "```") if e]
        safe = text[: len(text) - _partial_suffix(text, ends)].rstrip()
        safe = safe[:-1] if safe.endswith("}") else safe
        # what went out was scanned once: only the new part is read each time
        held = self._scan.copy().scan(safe).member if len(safe) > self._sent else None
        safe = safe[:held] if held is not None else safe
        if len(safe) > self._sent:
            out.append(ToolArgsDelta(safe[self._sent :]))
            self._sent = len(safe)
            self._scan.scan(safe)
        return out

    def _end_live(self, region: str, calls: list[Call] | None) -> list[ParseEvent]:
        """The call being streamed is complete (or cut short): the rest of its arguments,
        then the call whole; calls after it in the same region go whole."""
        assert self._live is not None
        cid, name, at = self._live
        self._live = None
        end = _object_end(region, _object_start(region))
        raw = region[at : end - 1] if end is not None else region[at:]
        if end is None:  # cut short: completed, so that the pieces still make JSON
            held = _unfinished_key(raw)  # a key not yet followed by its value goes
            base = raw[:held] if held is not None and held >= self._sent else raw
            done = _completed(base.rstrip(" \t\r\n"))
            raw = done if done is not None and done.startswith(raw[: self._sent]) else raw
        out: list[ParseEvent] = []
        if len(raw) > self._sent:
            out.append(ToolArgsDelta(raw[self._sent :]))
        if calls and calls[0][0] == name and end is not None:
            args = json.dumps(calls[0][1], ensure_ascii=False)
            rest = calls[1:]
        else:  # it did not parse as the call it began as: what was written, completed
            try:
                value = json.loads(raw)
            except ValueError:
                value = {}
            args = json.dumps(value if isinstance(value, dict) else {}, ensure_ascii=False)
            rest = []
        out.append(ToolCallEvent(cid, name, args, streamed=True))
        return out + [_event(c) for c in rest]

    def _as_text(self, text: str, rest: str) -> list[ParseEvent]:
        """Not a call: `text` goes out, `rest` is read again as text."""
        self._region = ""
        self._state = "text"
        self._buf = rest + self._buf
        return [TextDelta(text)]

    def _partial(self, region: str) -> Call | None:
        """A call cut short (the token limit): a declared tool's name and the arguments
        written so far, closed so that they parse."""
        m = re.search(r'"name"\s*:\s*"([^"\\]+)"', region)
        if m is None or m.group(1) not in self.tools:
            return None
        args = re.search(r'"(?:arguments|parameters)"\s*:\s*', region)
        if args is None:
            return m.group(1), {}
        try:
            value = json.loads(_close_json(region[args.end() :]))
        except ValueError:
            return m.group(1), {}
        return m.group(1), value if isinstance(value, dict) else {}

    def _parse(self, region: str) -> list[Call] | None:
        return self._parse_with(self.family.body, region)

    def _parse_with(self, body: str, region: str) -> list[Call] | None:
        try:
            calls = BODY_PARSERS[body](region)
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None
        if self.tools and any(name not in self.tools for name, _ in calls):
            return None
        return calls


# The head of a JSON call whose arguments can stream: its name, then its arguments.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _object_start(region: str) -> int:
    """Where a call object starts in a region: after a ``` fence opener, if any."""
    if region.startswith("```"):
        m = _FENCE_OPEN.match(region)
        return m.end() if m is not None else 0
    return 0


# What may open a bare call object in the text of a JSON-call family.
_SOFT_STARTS = ("{", "```")
_FENCE_OPEN = re.compile(r"```[A-Za-z]*[ \t]*\n?[ \t\r\n]*")
MAX_HELD = 64 * 1024  # a "{" that opens no object this long after is text


def _brackets(text: str, start: int = 0) -> tuple[list[tuple[int, str]], bool]:
    """The brackets of `text` from `start` that stand outside JSON strings (escapes
    respected), and whether the text ends inside a string."""
    out: list[tuple[int, str]] = []
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[]}":
            out.append((i, ch))
    return out, in_string


def _object_end(text: str, start: int) -> int | None:
    """The index after the JSON object opening at `start`, None while it is not closed."""
    depth = 0
    for i, ch in _brackets(text, start)[0]:
        depth += 1 if ch in "{[" else -1
        if depth == 0:
            return i + 1
    return None


def _close_json(text: str) -> str:
    """Cut-off JSON completed so that it parses: an open string and the open objects and
    arrays are closed; a dangling key or comma is dropped."""
    scan = _JsonScan().scan(text)
    out = text + ('"' if scan.in_string else "")
    out = re.sub(r'(,\s*"[^"]*"\s*:?\s*|,\s*|:\s*)$', "", out.rstrip())
    if out.rstrip().endswith(":"):
        out = out.rstrip()[:-1]
    return out + scan.closers()


class _JsonScan:
    """How far a JSON text has got, scanned once from its start and then onwards: open
    containers, strings, and where an object member whose key has no ":" yet begins
    (its comma, or just after its object's "{")."""

    def __init__(self) -> None:
        self.pos = 0
        self.containers: list[str] = []
        self.in_string = self.escaped = False
        self.member: int | None = None

    def copy(self) -> _JsonScan:
        other = _JsonScan()
        other.pos, other.containers = self.pos, list(self.containers)
        other.in_string, other.escaped, other.member = self.in_string, self.escaped, self.member
        return other

    def closers(self) -> str:
        """What closes the containers still open, innermost first."""
        return "".join("}" if c == "{" else "]" for c in reversed(self.containers))

    def scan(self, text: str) -> _JsonScan:
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
                self.member = None
            elif ch == ",":
                in_object = bool(self.containers) and self.containers[-1] == "{"
                self.member = i if in_object else None
            elif ch == ":":
                self.member = None
        self.pos = max(self.pos, len(text))
        return self


def _unfinished_key(text: str) -> int | None:
    """Where `text` (JSON cut short) ends in an object member whose key has no ":" yet,
    None if it does not (see _JsonScan)."""
    return _JsonScan().scan(text).member


def _completed(text: str) -> str | None:
    """JSON cut short, with the least appended that makes it parse (a string closed, a
    dangling key given null, the open brackets closed); None if nothing will do."""
    for extra in ("", '"', " null", '": null'):
        t = text + extra
        scan = _JsonScan().scan(t)
        if scan.in_string:
            continue
        candidate = t + scan.closers()
        try:
            json.loads(candidate)
        except ValueError:
            continue
        return candidate
    return None


def _event(call: Call) -> ToolCallEvent:
    name, args = call
    return ToolCallEvent(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def _earliest(text: str, markers: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, m)
    return best


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:k]):
                keep = k
                break
    return keep
