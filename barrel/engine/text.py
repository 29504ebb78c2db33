"""From sampled tokens to text: incremental UTF-8 and stop strings.

Both run in the engine thread, once per sampled token of each sequence.
"""

from __future__ import annotations

import codecs


class Utf8Stream:
    """Token bytes in, whole characters out: a multi-byte character split across tokens
    is held until it is complete, so no chunk ever carries broken UTF-8."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        """At the end: an incomplete trailing sequence becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings across chunk boundaries. Text that could be the start of a stop
    string is held back until it is known not to be one; a matched stop string and
    everything after it is never emitted."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string matched or None)."""
        if not self.stops:
            return text, None
        buf = self._held + text
        found: tuple[int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            self._held = ""
            return buf[: found[0]], found[1]
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), keep, -1):
                if buf.endswith(stop[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
