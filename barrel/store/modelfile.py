"""Ollama's Modelfile: parse, check parameters, render back.

    FROM <model name | ./file.gguf | sha256:<digest>>
    FROM <./projector.gguf | sha256:<digest>>   (a second FROM: an image or audio projector)
    PARAMETER <name> <value>          (repeatable; `stop` accumulates)
    SYSTEM / TEMPLATE / LICENSE <text | "text" | \"\"\"multi-line\"\"\">
    MESSAGE <system|user|assistant|tool> <text>
    ADAPTER <file | sha256:<digest>>

Instructions are case-insensitive; `#` starts a comment line. Every error names its line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from barrel.errors import InvalidRequest


class ModelfileError(InvalidRequest):
    code = "invalid_modelfile"


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def looks_like_path(text: str) -> bool:
    """A FROM (or ADAPTER) naming a file rather than a model or a digest."""
    return text.startswith(("/", "./", "../", "~")) or text.endswith(".gguf") or "\\" in text


WEIGHT_RESIDENCY = ("eager", "lazy", "pinned", "lazy_then_pin_resident")

# Every llama.cpp / Ollama parameter Barrel accepts, with its type.
PARAMETERS: dict[str, Any] = {
    "num_ctx": int,
    "num_seq_max": int,
    "num_batch": int,
    "num_gpu": int,
    "num_thread": int,
    "num_keep": int,
    "num_predict": int,
    "seed": int,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "typical_p": float,
    "tfs_z": float,
    "temperature": float,
    "repeat_penalty": float,
    "repeat_last_n": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "penalize_newline": _bool,
    "mirostat": int,
    "mirostat_tau": float,
    "mirostat_eta": float,
    "dry_multiplier": float,
    "dry_base": float,
    "dry_allowed_length": int,
    "dry_penalty_last_n": int,
    "stop": str,
    "use_mmap": _bool,
    "use_mlock": _bool,
    "numa": _bool,
    "flash_attn": _bool,
    "kv_cache_type": str,
    "speculation": str,  # ngram | off
    "draft_max": int,
    "draft_model": str,  # a model of the same vocabulary that drafts for this one
    "keep_alive": str,
    "weight_residency": str,
    "queue_depth": int,  # requests that may wait for this model beyond num_seq_max
    "queue_timeout": float,  # seconds a request may wait in this model's queue
}


def check_parameter(name: str, value: Any) -> Any:
    """The parameter's value converted to its type; raises ValueError otherwise."""
    kind = PARAMETERS.get(name)
    if kind is None:
        raise ValueError(f"unknown parameter {name!r}")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is _bool:
        if isinstance(value, str):
            value = _bool(value)
        elif not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean")
    elif isinstance(value, str) and kind is not str:
        value = kind(value)
    elif isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {kind.__name__}")
    if name == "weight_residency" and value not in WEIGHT_RESIDENCY:
        raise ValueError(f"weight_residency must be one of {', '.join(WEIGHT_RESIDENCY)}")
    if name in ("num_ctx", "num_seq_max") and value < 1:
        raise ValueError(f"{name} must be positive")
    return value


def normalize_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """Check a parameters mapping (the structured /api/create form); `stop` is a list."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        try:
            if name == "stop":
                values = value if isinstance(value, list) else [value]
                out["stop"] = [check_parameter("stop", v) for v in values]
            else:
                out[name] = check_parameter(name, value)
        except (ValueError, TypeError) as exc:
            raise ModelfileError(f"parameter {name}: {exc}") from None
    return out


@dataclass
class Modelfile:
    from_: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    # FROMs after the first: multimodal projectors (Ollama's way of adding one)
    projectors: list[str] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"FROM {self.from_}", *(f"FROM {p}" for p in self.projectors)]
        if self.template is not None:
            lines.append(f'TEMPLATE """{self.template}"""')
        if self.system is not None:
            lines.append(f'SYSTEM """{self.system}"""')
        lines += [f"ADAPTER {a}" for a in self.adapters]
        lines += [f"PARAMETER {p}" for p in render_parameters(self.parameters).splitlines()]
        lines += [f"MESSAGE {m['role']} {json.dumps(m['content'])}" for m in self.messages]
        lines += [f'LICENSE """{text}"""' for text in self.license]
        return "\n".join(lines) + "\n"


def render_parameters(params: dict[str, Any]) -> str:
    """Ollama's /api/show `parameters` text: one `name value` line each."""
    lines = []
    for name, value in params.items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                shown = json.dumps(v)
            else:
                shown = str(v).lower() if isinstance(v, bool) else str(v)
            lines.append(f"{name:<30} {shown}")
    return "\n".join(lines)


_ROLES = {"system", "user", "assistant", "tool"}


def parse(text: str) -> Modelfile:
    mf = Modelfile()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        lineno = i + 1
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command = command.upper()
        rest = rest.strip()
        if rest.startswith('"""'):
            body = rest[3:]
            while '"""' not in body:
                if i >= len(lines):
                    raise ModelfileError(f'line {lineno}: unterminated """ string')
                body += "\n" + lines[i]
                i += 1
            value, _, after = body.partition('"""')
            if after.strip():
                raise ModelfileError(f'line {lineno}: unexpected text after the closing """')
        else:
            value = _unquote(rest, lineno)
        _apply(mf, command, value, lineno)
    if not mf.from_:
        raise ModelfileError("no FROM line")
    return mf


def _unquote(text: str, lineno: int) -> str:
    if text.startswith('"'):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ModelfileError(f"line {lineno}: bad quoted string") from None
        if not isinstance(value, str):
            raise ModelfileError(f"line {lineno}: bad quoted string")
        return value
    return text


def _apply(mf: Modelfile, command: str, value: str, lineno: int) -> None:
    if command == "FROM":
        if not value:
            raise ModelfileError(f"line {lineno}: FROM needs a model, a file or a digest")
        if mf.from_:
            mf.projectors.append(value)
        else:
            mf.from_ = value
    elif command == "PARAMETER":
        name, _, raw = value.partition(" ")
        raw = _unquote(raw.strip(), lineno)
        if not raw:
            raise ModelfileError(f"line {lineno}: PARAMETER needs a name and a value")
        try:
            checked = check_parameter(name, raw)
        except (ValueError, TypeError) as exc:
            raise ModelfileError(f"line {lineno}: {exc}") from None
        if name == "stop":
            mf.parameters.setdefault("stop", []).append(checked)
        else:
            mf.parameters[name] = checked
    elif command == "SYSTEM":
        mf.system = value
    elif command == "TEMPLATE":
        mf.template = value
    elif command == "LICENSE":
        mf.license.append(value)
    elif command == "ADAPTER":
        if not value:
            raise ModelfileError(f"line {lineno}: ADAPTER needs a file or a digest")
        mf.adapters.append(value)
    elif command == "MESSAGE":
        role, _, content = value.partition(" ")
        if role.lower() not in _ROLES:
            raise ModelfileError(f"line {lineno}: MESSAGE role must be one of {sorted(_ROLES)}")
        mf.messages.append({"role": role.lower(), "content": _unquote(content.strip(), lineno)})
    else:
        raise ModelfileError(f"line {lineno}: unknown instruction {command!r}")
