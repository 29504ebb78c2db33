"""Ollama Modelfile TEMPLATEs are Go templates; Barrel renders Jinja2. The simple ones —
the classic single-turn prompt shape — are converted; anything else is refused clearly
(400) rather than guessed.

Converted: `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`, `{{ if .System }}`,
`{{ if .Prompt }}`, `{{ else }}`, `{{ end }}`, with `{{-`/`-}}` trimming. The result
renders the conversation turn by turn: each user message is a .Prompt, the assistant
reply after it the .Response, the system message the .System.
"""

from __future__ import annotations

import re

from barrel.errors import InvalidRequest

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_FIELDS = {".System": "system", ".Prompt": "prompt", ".Response": "response"}


class UnsupportedTemplate(InvalidRequest):
    code = "unsupported_template"


def is_go_template(source: str) -> bool:
    return bool(re.search(r"\{\{-?\s*(\.|if \.|range \.|end\b)", source)) and "{%" not in source


def go_to_jinja(source: str) -> str:
    """Translate a simple Go TEMPLATE into a Jinja2 chat template."""
    body = []
    pos = 0
    depth = 0
    for m in _ACTION.finditer(source):
        body.append(_literal(source[pos : m.start()]))
        pos = m.end()
        left, action, right = m.group(1), m.group(2), m.group(3)
        open_ = "{{-" if left else "{{"
        close = "-}}" if right else "}}"
        sopen = "{%-" if left else "{%"
        sclose = "-%}" if right else "%}"
        if action in _FIELDS:
            body.append(f"{open_} {_FIELDS[action]} {close}")
        elif action.startswith("if ") and action[3:].strip() in _FIELDS:
            depth += 1
            body.append(f"{sopen} if {_FIELDS[action[3:].strip()]} {sclose}")
        elif action == "else":
            body.append(f"{sopen} else {sclose}")
        elif action == "end":
            depth -= 1
            body.append(f"{sopen} endif {sclose}")
        else:
            raise UnsupportedTemplate(
                f"the Go template uses {{{{ {action} }}}}, which Barrel cannot convert; "
                "give the model a Jinja2 chat template instead"
            )
    body.append(_literal(source[pos:]))
    if depth != 0:
        raise UnsupportedTemplate("the Go template's if/end blocks do not balance")
    turn = "".join(body)
    # One rendering of the Go template per user turn, as Ollama's legacy templates run.
    return (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content %}"
        "{% endif %}{% endfor %}"
        "{% set turns = [] %}"
        "{% for m in messages %}"
        "{% if m.role == 'user' %}{% set _ = turns.append({'prompt': m.content, 'response': ''}) %}"
        "{% elif m.role == 'assistant' and turns %}"
        "{% set _ = turns[-1].update({'response': m.content or ''}) %}{% endif %}"
        "{% endfor %}"
        "{% for t in turns %}{% set system = ns.system if loop.first else '' %}"
        "{% set prompt = t.prompt %}{% set response = t.response %}" + turn + "{% endfor %}"
    )


def _literal(text: str) -> str:
    """Go template text, escaped for Jinja (no block or expression delimiters)."""
    if not text:
        return ""
    return "{% raw %}" + text + "{% endraw %}"
