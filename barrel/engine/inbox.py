"""The commands other threads put in the engine's inbox (`Engine.submit`, `cancel`,
`embed`, `pin`, `stop`, ...), and a pinned prefix's prefill job. The engine thread is the
only reader; a command is immutable once queued."""

from __future__ import annotations

from dataclasses import dataclass

from barrel.engine.kvcache import Slot
from barrel.engine.run import Run
from barrel.engine.types import RequestId
from barrel.futures import Reply


@dataclass(frozen=True)
class Submit:
    """A request for the engine thread (`Engine.submit`)."""

    run: Run


@dataclass(frozen=True)
class Cancel:
    """Stop a request: the client is gone."""

    id: RequestId


@dataclass(frozen=True)
class Embed:
    """Embed these inputs and reply with one vector each."""

    inputs: list[list[int]]
    normalize: bool
    reply: Reply[list[list[float]]]


@dataclass(frozen=True)
class Pin:
    """Keep these tokens as a pinned prefix; reply with how many are pinned."""

    tokens: list[int]
    reply: Reply[int]
    scope: str = ""


@dataclass(frozen=True)
class Fault:
    """Tests only: raise `error` in the engine thread."""

    error: BaseException


class Wake:
    """A paused stream's reader caught up: re-evaluate."""


class Stop:
    """End the engine thread."""

    pass


@dataclass
class PinJob:
    """Prefilling a pinned prefix: low priority, no logits, no output."""

    slot: Slot
    tokens: list[int]
    reply: Reply[int]
    n_past: int = 0
