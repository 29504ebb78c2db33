"""Chat templates: the model's Jinja2 template (from the GGUF, or a Modelfile TEMPLATE),
rendered in a sandbox the way Hugging Face transformers renders it.

The sandbox (`ImmutableSandboxedEnvironment`) keeps templates — untrusted input shipped
inside model files — from reaching Python internals or mutating what they are given.
Templates get `messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`,
any extra keyword (`enable_thinking`, `reasoning_effort`, ...), and the helpers
`raise_exception` and `strftime_now`; `tojson` behaves like transformers' (no HTML
escaping, optional indent). A template that fails to render is a 400, not a 500.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Generic, TypeVar

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import SandboxedEnvironment

from barrel.errors import InvalidRequest
from barrel.pipeline.deadline import Expired, budget
from barrel.pipeline.gotemplate import go_to_jinja, is_go_template


class TemplateError(InvalidRequest):
    code = "template_error"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers):
    rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> None:
    raise TemplateError(f"the chat template refused the request: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_listify,
    )


def _listify(value: Any) -> Any:
    # `tools | map(attribute='function') | tojson` hands json a generator.
    if isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # Mutable sandbox: templates such as Kimi's build lists with .append(); they only
    # ever see deep copies of the request, and the sandbox still blocks internals.
    env = SandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"the chat template does not parse (line {exc.lineno}): {exc.message}"
        ) from None


_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "abcdefghi",
            "type": "function",
            "function": {"name": "probe_fn", "arguments": {"a": 1}},
        }
    ],
}
_PROBE_RESULT = {"role": "tool", "tool_call_id": "abcdefghi", "name": "probe_fn", "content": "ok"}
_PROBE_TOOLS = [
    {"type": "function", "function": {"name": "probe_fn", "parameters": {"type": "object"}}}
]


K = TypeVar("K")
V = TypeVar("V")
HEADS_KEPT = 32


class Lru(Generic[K, V]):
    """A small least-recently-used map, safe from several threads (renders run in
    worker threads)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


class ChatTemplate:
    """A compiled template plus what it can take, found by probing it once (as llama.cpp
    does): whether it accepts a system message, and whether tool-call arguments must be
    JSON strings rather than objects. `render` adapts the request to both."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        render_budget_s: float | None = None,
    ) -> None:
        if not source.strip():
            raise TemplateError("the model has no chat template")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # A TEMPLATE is client input: each render (and the probes together) gets this long.
        self.render_budget_s = render_budget_s
        self._template = _compile(source)
        # the tokens of rendered system + tools heads, by what was rendered (a conversation
        # renders the same head every turn: barrel.pipeline.chat._static_prefix)
        self.heads: Lru[str, list[int]] = Lru(HEADS_KEPT)
        try:
            with budget(render_budget_s):
                self._probe()
        except Expired:
            raise self._too_slow() from None

    def _too_slow(self) -> TemplateError:
        return TemplateError(
            f"the chat template took longer than {self.render_budget_s:g}s to render"
        )

    def _probe(self) -> None:
        self.supports_system = self._renders([{"role": "system", "content": "s"}, _PROBE_USER])
        self.supports_tool_results = self._renders(
            [_PROBE_USER, _string_arguments(_PROBE_CALL), _PROBE_RESULT, _PROBE_USER], _PROBE_TOOLS
        ) or self._renders([_PROBE_USER, _PROBE_CALL, _PROBE_RESULT, _PROBE_USER], _PROBE_TOOLS)
        self.object_arguments = self._renders(
            [_PROBE_USER, _PROBE_CALL], _PROBE_TOOLS
        ) or not self._renders([_PROBE_USER, _string_arguments(_PROBE_CALL)], _PROBE_TOOLS)
        self.renders_tools = self._shows_tools()
        self.next_turn = self._next_turn()

    def _next_turn(self) -> str:
        """The text the template puts between an assistant's answer and the next user's
        words (ChatML: `<|im_end|>\n<|im_start|>user\n`); "" when the template does not
        render such a conversation plainly. The engine prefills it into a finished
        sequence while idle (EngineRequest.next_turn)."""
        answer, question = "BarrelProbeAnswer", "BarrelProbeQuestion"
        turns = [_PROBE_USER, {"role": "assistant", "content": answer}]
        try:
            text = self._render([*turns, {"role": "user", "content": question}], None, False, {})
        except Exception:  # noqa: BLE001 - a probe: any failure means "not like this"
            return ""
        start, end = text.find(answer), text.find(question)
        if start < 0 or end < start + len(answer) or text.count(answer) != 1:
            return ""
        between = text[start + len(answer) : end]
        return between if len(between) <= 64 else ""

    def _shows_tools(self) -> bool:
        """Whether the tool definitions reach the prompt at all (some templates take
        `tools` and print nothing of them)."""
        probe = [{"role": "system", "content": "s"}, _PROBE_USER]
        try:
            text = self._render(probe, copy.deepcopy(_PROBE_TOOLS), True, {})
        except Exception:  # noqa: BLE001 - a probe: any failure means "not like this"
            try:
                text = self._render([_PROBE_USER], copy.deepcopy(_PROBE_TOOLS), True, {})
            except Exception:  # noqa: BLE001
                return False
        return "probe_fn" in text

    def _renders(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> bool:
        try:
            self._render(messages, tools, True, {})
        except Exception:  # noqa: BLE001 - a probe: any failure means "not like this"
            return False
        return True

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        msgs = copy.deepcopy([dict(m) for m in messages])
        if not self.supports_system:
            msgs = _merge_system(msgs)
        if not self.supports_tool_results:
            msgs = _tool_results_as_user(msgs)
        if not self.object_arguments:
            msgs = [_string_arguments(m) for m in msgs]
        try:
            tool_list = [dict(t) for t in copy.deepcopy(list(tools))] if tools else None
            with budget(self.render_budget_s):
                return self._render(msgs, tool_list, add_generation_prompt, kwargs)
        except Expired:
            raise self._too_slow() from None
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"the chat template tried something unsafe: {exc}") from None
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
        ) as exc:
            raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        extra: dict[str, Any] = {}
        if tools:
            tools = [_flat_tool(t) for t in tools]
            # firefunction-style templates read the tool list as a JSON string
            extra["functions"] = json.dumps([t.get("function", t) for t in tools], indent=4)
            extra["datetime"] = time.strftime("%d %b %Y")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
            **kwargs,
        )


def _flat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's {"type", "function": {...}} plus the function's fields at the top level
    and Cohere's `parameter_definitions`, which some templates read directly."""
    fn = tool.get("function")
    if not isinstance(fn, dict):
        return tool
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    definitions = {
        name: {
            "description": prop.get("description", ""),
            "type": prop.get("type", "string"),
            "required": name in required,
        }
        for name, prop in (params.get("properties") or {}).items()
        if isinstance(prop, dict)
    }
    return {"description": "", "parameter_definitions": definitions, **fn, **tool}


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates without a system role: fold system text into the first user turn."""
    system = "\n\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    rest = [m for m in messages if m.get("role") != "system"]
    if system:
        for m in rest:
            if m.get("role") == "user":
                m["content"] = f"{system}\n\n{m.get('content') or ''}"
                break
        else:
            rest.insert(0, {"role": "user", "content": system})
    return rest


def _tool_results_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates without a tool role: tool results become user turns, and an
    assistant's calls are written into its text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "tool":
            payload = {"tool_response": {"name": m.get("name", ""), "content": m.get("content")}}
            if out and out[-1].get("role") == "user":
                out[-1]["content"] = f"{out[-1].get('content') or ''}\n{json.dumps(payload)}"
            else:
                out.append({"role": "user", "content": json.dumps(payload, ensure_ascii=False)})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [
                {
                    "name": c.get("function", {}).get("name"),
                    "arguments": c.get("function", {}).get("arguments"),
                }
                for c in m["tool_calls"]
            ]
            text = (m.get("content") or "") + json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant", "content": text})
        else:
            out.append(m)
    return out


def _string_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message)
    out["tool_calls"] = []
    for call in calls:
        call = copy.deepcopy(call)
        fn = call.get("function", {})
        if isinstance(fn.get("arguments"), dict | list):
            fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
        out["tool_calls"].append(call)
    return out


def make_template(
    source: str, bos_token: str = "", eos_token: str = "", render_budget_s: float | None = None
) -> ChatTemplate:
    """The model's chat template: a Modelfile TEMPLATE (Go, converted when simple) or the
    GGUF's Jinja2 template. Each render gets `render_budget_s` (a 400 beyond)."""
    if is_go_template(source):
        source = go_to_jinja(source)
    return ChatTemplate(source, bos_token, eos_token, render_budget_s)
