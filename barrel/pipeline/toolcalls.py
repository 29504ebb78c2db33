"""Tool calls and reasoning in generated text: one streaming parser driven by the family
table (barrel.pipeline.families).

The parser streams plain text out as soon as it cannot be the start of a marker, hands
reasoning out separately, and parses each tool-call region when it closes. Markers that
are control tokens vanish when a model's output is detokenized without special tokens;
every family also accepts its marker-stripped shape. Text that does not parse as a call
comes back as content: output is never dropped. A JSON call whose name is a declared
tool's streams its arguments as they are written (barrel.pipeline.jsonscan).

    parser = ToolCallParser(detect_family(template), tool_names)
    events = parser.feed(text) ... + parser.finish()
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from enum import Enum

from barrel.pipeline.events import (
    ReasoningDelta,
    TextDelta,
    ToolArgsDelta,
    ToolCallEvent,
    ToolCallStart,
)
from barrel.pipeline.families import BODY_PARSERS, Call, Family, new_call_id
from barrel.pipeline.jsonscan import JsonScan, complete_json, object_end

ParseEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolArgsDelta | ToolCallEvent


class State(Enum):
    TEXT = "text"  # content, watching for markers
    REASONING = "reasoning"  # inside a reasoning block
    CALL = "call"  # inside a marked tool-call region
    OBJECT = "object"  # a bare (or fenced) JSON object that may be a call


class ToolCallParser:
    """Feed generated text in any chunks; get content, reasoning and tool calls out.
    Owns the text held back (a possible marker or call) and the call being streamed.

    `tools` names the request's tools: a parsed call to another name is not a call, and
    with no tools nothing is parsed as one (only reasoning is separated).
    """

    def __init__(self, fam: Family, tools: Iterable[str] = (), *, reasoning: bool = True) -> None:
        self.family = fam
        self.tools = set(tools)
        self.reasoning = reasoning
        self._buf = ""
        self._state = State.TEXT
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
        self._scan = JsonScan()  # of what of its arguments went out
        self._read: dict[State, Callable[[list[ParseEvent], bool], bool]] = {
            State.TEXT: self._read_text,
            State.REASONING: self._read_reasoning,
            State.CALL: self._read_call,
            State.OBJECT: self._read_object,
        }

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
        if self._state is State.CALL:
            out += self._close_region(self._region + self._buf, final=True)
        elif self._state is State.OBJECT:
            self._region += self._buf
            self._buf = ""
            out += self._object(final=True) or []
        elif self._state is State.REASONING and self._buf:
            out.append(ReasoningDelta(self._buf))
        elif self._buf:
            out.append(TextDelta(self._buf))
        self._buf = self._region = ""
        return [e for e in out if not isinstance(e, TextDelta) or e.text]

    def _drain(self, final: bool) -> list[ParseEvent]:
        """Read the held text, state by state: each reader appends what it can say now
        and answers whether there is more to read before the next chunk."""
        out: list[ParseEvent] = []
        while self._buf and self._read[self._state](out, final):
            pass
        return out

    def _read_reasoning(self, out: list[ParseEvent], final: bool) -> bool:
        end = self.family.reasoning[1]
        at = self._buf.find(end)
        if at < 0:
            keep = _partial_suffix(self._buf, [end])
            if len(self._buf) > keep:
                out.append(ReasoningDelta(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
            return False
        if at:
            out.append(ReasoningDelta(self._buf[:at]))
        self._buf = self._buf[at + len(end) :]
        self._state = State.TEXT
        self._after_reasoning = True
        return True

    def _read_call(self, out: list[ParseEvent], final: bool) -> bool:
        self._region += self._buf
        self._buf = ""
        call_end = self.family.end
        at = self._region.find(call_end) if call_end else -1
        if at < 0 or call_end is None:
            out += self._stream(self._region)
            return False
        region, self._buf = self._region[:at], self._region[at + len(call_end) :]
        self._region = ""
        self._state = State.TEXT
        out += self._close_region(region, final=False)
        return True

    def _read_object(self, out: list[ParseEvent], final: bool) -> bool:
        self._region += self._buf
        self._buf = ""
        decided = self._object(final=False)
        if decided is None:
            out += self._stream(self._region)
            return False
        out += decided
        return True

    def _read_text(self, out: list[ParseEvent], final: bool) -> bool:
        if self._after_call:
            return self._read_after_call(final)
        if self._after_reasoning:  # the newlines that follow a reasoning block
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return False
            self._after_reasoning = False
        if not self._started:
            decided = self._read_start()
            if decided is not None:
                return decided
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
            return False
        at, marker = found
        if at:
            out.append(TextDelta(self._buf[:at]))
            self._spoke = self._spoke or bool(self._buf[:at].strip())
        if marker in self.family.noise and marker not in self._markers:
            self._buf = self._buf[at + len(marker) :]
            return True
        if marker in soft:
            if at and not self._spoke and not self._buf[:at].strip():
                out.pop()  # only whitespace before a call object: not content
            self._buf = self._buf[at:]
            self._state = State.OBJECT
            self._region = ""
            return True
        self._buf = self._buf[at + len(marker) :]
        if self.reasoning and marker == self.family.reasoning[0]:
            self._state = State.REASONING
        else:
            self._state = State.CALL
            self._region = marker if self.family.keep_start else ""
        return True

    def _read_after_call(self, final: bool) -> bool:
        """A stray closing fence after a bare call object is not content."""
        rest = self._buf.lstrip()
        if not rest and final:
            self._buf = ""  # only whitespace after the last call
            return False
        if not rest or ("```".startswith(rest[:3]) and len(rest) < 3 and not final):
            return False
        if rest.startswith("```") and self._after_call != "fence":
            self._buf = rest[3:]
            self._after_call = "fence"  # closed: only whitespace may follow it
            return True
        self._after_call = False
        return True

    def _read_start(self) -> bool | None:
        """The output's start: a marker-stripped call shape there is held to the end (or,
        a call object with a declared tool's name, read as one). None: plain text."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        shapes = list(self.family.stripped)
        if self.family.stripped_names:
            shapes += list(self.tools)
        if self.tools and any(stripped.startswith(s) or s.startswith(stripped) for s in shapes):
            head = _CALL_HEAD.match(stripped, _object_start(stripped))
            if not (self._bare_calls and head and head.group(1) in self.tools):
                return False  # a marker-stripped call? undecided until the output ends
            # a call object with a declared tool's name: read (and streamed) as one
            self._started, self._state, self._region = True, State.OBJECT, ""
            self._buf = stripped
            return True
        self._started = True
        return None

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
        end = object_end(region, start)
        if end is None:
            if not final and len(region) < MAX_HELD:
                return None
            partial = self._partial(region[start:]) if final else None
            self._region = ""
            self._state = State.TEXT
            if self._live is not None:
                return self._end_live(region, [partial] if partial is not None else None)
            if partial is not None:
                return [_event(partial)]
            return [TextDelta(region)]
        calls = self._parse_with("json", region[start:end])
        if calls is None and self._live is None:
            return self._as_text(region[:1], region[1:])
        self._region = ""
        self._state = State.TEXT
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
                JsonScan(),
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
        end = object_end(region, _object_start(region))
        raw = region[at : end - 1] if end is not None else region[at:]
        if end is None:  # cut short: completed, so that the pieces still make JSON
            done = complete_json(raw, keep=self._sent)
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
        self._state = State.TEXT
        self._buf = rest + self._buf
        return [TextDelta(text)]

    def _partial(self, region: str) -> Call | None:
        """A call cut short (the token limit): a declared tool's name and the arguments
        written so far, completed so that they parse."""
        m = re.search(r'"name"\s*:\s*"([^"\\]+)"', region)
        if m is None or m.group(1) not in self.tools:
            return None
        args = re.search(r'"(?:arguments|parameters)"\s*:\s*', region)
        done = complete_json(region[args.end() :]) if args is not None else None
        value = json.loads(done) if done is not None else {}
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
