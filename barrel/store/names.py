"""Model names and digests: strict grammars, checked before any path is built.

A name is `[host/][namespace/]model[:tag]`, Ollama's shape: `qwen:0.5b` is
`registry.ollama.ai/library/qwen:0.5b`; `hf.co/org/repo:Q4_K_M` names a Hugging Face
repository and quantisation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from barrel.errors import InvalidRequest

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MAX_NAME = 350

_HOST = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9.-]{0,251}[a-zA-Z0-9])?(?::[0-9]{1,5})?$")
_PART = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,79}$")
_TAG = re.compile(r"^[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


class InvalidName(InvalidRequest):
    code = "invalid_model_name"


@dataclass(frozen=True, order=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> ModelName:
        if not text or len(text) > MAX_NAME:
            raise InvalidName(f"invalid model name {text[:80]!r}: 1 to {MAX_NAME} characters")
        raw = text.strip()
        name, _, tag = raw.rpartition(":") if ":" in raw.rsplit("/", 1)[-1] else (raw, "", "")
        tag = tag or DEFAULT_TAG
        parts = name.split("/")
        if len(parts) == 1:
            host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
        elif len(parts) == 2:
            host, (namespace, model) = DEFAULT_HOST, parts
        elif len(parts) == 3:
            host, namespace, model = parts
        else:
            raise InvalidName(f"invalid model name {text!r}: at most host/namespace/model:tag")
        for label, value, rx in (
            ("host", host, _HOST),
            ("namespace", namespace, _PART),
            ("model", model, _PART),
            ("tag", tag, _TAG),
        ):
            if not rx.match(value) or ".." in value:
                raise InvalidName(f"invalid model name {text!r}: bad {label} {value!r}")
        return cls(host.lower(), namespace, model, tag)

    def __str__(self) -> str:
        """The short form Ollama shows: host and namespace only when not the defaults."""
        if self.host == DEFAULT_HOST and self.namespace == DEFAULT_NAMESPACE:
            return f"{self.model}:{self.tag}"
        if self.host == DEFAULT_HOST:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        return (self.host, self.namespace, self.model, self.tag)


def parse_digest(text: str) -> str:
    """`sha256:<64 hex>` (or Ollama's file form `sha256-<hex>`) -> the hex. Anything
    else is refused before it can reach a path."""
    m = _DIGEST.match(text or "")
    if m is None:
        raise InvalidRequest(f"invalid digest {text[:80]!r}: expected sha256:<64 hex digits>")
    return m.group(1)
