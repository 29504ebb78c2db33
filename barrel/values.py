"""Values that cross the layers unchanged: the engine makes them, the pipeline passes
them on, the dialects' codecs render them. One definition, imported by each layer (no
conversion between an engine's and an API's copy).

A leaf: it imports nothing of Barrel, so the codecs load where llama.cpp is not
installed (tests/test_layers.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position, with its log-probability."""

    token: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its log-probability given the tokens before it, and the top ones.
    `logprob` is None only for a prompt's first token (nothing before it)."""

    token: int
    text: str
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    """The tokens of one answer: the prompt's, split by where they came from, and the
    generated ones."""

    prompt_tokens: int
    completion_tokens: int
    prompt_reused: int  # taken from the KV cache (a parked sequence or the state cache)
    prompt_computed: int  # prefilled this time
    # Why nothing (or less) was reused although a prefix matched, e.g. a sliding-window
    # model refused a partial KV removal: "" when reuse went as planned.
    reuse_note: str = ""


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model as `ps` reports it (barrel.actors.lifecycle makes it; the dialects
    shape it: barrel.http.codecs)."""

    name: str
    size: int  # bytes allocated: weights and KV cache
    digest: str  # 64 hex
    details: dict[str, Any]
    expires_at: float | None  # wall-clock seconds; None: kept loaded
    context_length: int
    active: int  # leases held
    running: int  # requests admitted
    queued: int  # requests waiting in the model's queue
    draining: bool = False  # an unload was asked for: it comes when its requests end
