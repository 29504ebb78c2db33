"""One pure codec per dialect: request body -> neutral request, pipeline events ->
stream frames and the full response, errors -> the dialect's frame after a stream began.

A codec does no I/O and reads no clock or random source of its own (they come in a
`Stamp`), so its unit suite runs without a model, a server or an event loop. The generic
handler (`barrel.http.generate`) drives it: decode, `check`, open a model session, then
`begin` / `feed` / `end` (or `full`) while it writes the frames to the wire.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec

from barrel.errors import BarrelError
from barrel.pipeline.events import ChatEvent

T = TypeVar("T")


def read_body(raw: bytes, kind: type[T]) -> T:
    """A request body as `kind`, read as leniently as the dialects' own servers read it
    (pydantic's lax mode behind OpenAI's and Anthropic's, Go's decoder behind Ollama's):
    a top-level field sent as null is a field not sent (OpenAI's reference marks optional
    fields nullable; Go skips a null), a number with an empty fraction (4096.0) is an
    integer, as JSON Schema counts it, and numbers and booleans sent as strings ("2",
    "false") or booleans as 0 / 1 are read as what they spell. Anything else is refused:
    msgspec.ValidationError (a DecodeError too) or DecodeError; each codec words its 400."""
    data = msgspec.json.decode(raw or b"{}")
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if v is not None}
    return msgspec.convert(data, type=kind, strict=False)


@dataclass(frozen=True)
class Data:
    """A JSON frame: an SSE `data:` line (named `event` when given) or an NDJSON line."""

    payload: dict[str, Any]
    event: str | None = None


@dataclass(frozen=True)
class Comment:
    """An SSE comment (`: text`): kept-alive streams; NDJSON leaves it out."""

    text: str


@dataclass(frozen=True)
class EndMarker:
    """OpenAI's `data: [DONE]`."""


DONE = EndMarker()
Frame = Data | Comment | EndMarker


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Stamp:
    """The clock and id source an encoder uses (fixed ones in the codec tests)."""

    now: Callable[[], float] = time.time  # wall clock: created_at fields
    perf: Callable[[], float] = time.perf_counter  # durations
    ids: Callable[[str], str] = new_id


STAMP = Stamp()


@dataclass(frozen=True)
class Begin:
    """What the handler knows once the prompt is prepared."""

    prompt_tokens: int
    started: float = 0.0  # Stamp.perf() when the request arrived
    load_s: float = 0.0  # time spent waiting for the queue and the load
    prompt: tuple[int, ...] = field(default=())
    echo: tuple[str, ...] = field(default=())  # per run, the text before its answer
    audio_seconds: float = 0.0  # the length of the request's audio clips


class Encoder(Protocol):
    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        """Frames while the request waits in the queue (position) or for the load."""
        ...

    def begin(self, begin: Begin) -> list[Frame]: ...

    def feed(self, index: int, event: ChatEvent) -> list[Frame]: ...

    def end(self) -> list[Frame]: ...

    def full(self) -> dict[str, Any]:
        """The whole response, folded from the events fed so far (after `end`)."""
        ...

    def error(self, err: BarrelError) -> list[Frame]:
        """The dialect's error frame for a stream that already began."""
        ...
