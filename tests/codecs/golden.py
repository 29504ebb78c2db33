"""What the codec suites share: a fixed clock and id source, and pipeline events."""

from __future__ import annotations

import json
from typing import Any

from barrel.http.codecs import Comment, Data, EndMarker, Frame, Stamp
from barrel.pipeline.events import Finished
from barrel.values import TokenLogprob, Usage

NOW = 1_700_000_000.25


class Ticks:
    """perf_counter stand-in: 10.0, then 10.5, 11.0, ... one half second a read."""

    def __init__(self) -> None:
        self.t = 9.5

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def stamp() -> Stamp:
    return Stamp(now=lambda: NOW, perf=Ticks(), ids=lambda prefix: f"{prefix}X")


USAGE = Usage(prompt_tokens=39, completion_tokens=7, prompt_reused=30, prompt_computed=9)


def finished(reason: str = "stop", **kw: Any) -> Finished:
    return Finished(reason, USAGE, prefill_s=0.25, decode_s=1.5, **kw)


def lp(text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(1, text, logprob)


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def wire(frames: list[Frame]) -> list[Any]:
    """Frames as comparable plain values: (event, payload), ": comment" or "[DONE]"."""
    out: list[Any] = []
    for f in frames:
        if isinstance(f, Data):
            out.append((f.event, f.payload) if f.event else f.payload)
        elif isinstance(f, Comment):
            out.append(f": {f.text}")
        elif isinstance(f, EndMarker):
            out.append("[DONE]")
    return out
