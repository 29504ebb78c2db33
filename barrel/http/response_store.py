"""Responses kept for `previous_response_id`: in memory, each for a time to live, the
oldest dropped first beyond a count. Only the event loop touches it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from barrel.pipeline.request import Message


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object, as it was sent
    messages: tuple[Message, ...]  # the conversation it ended
    expires: float


class ResponseStore:
    def __init__(
        self, ttl_s: float, max_stored: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_stored = max_stored
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], messages: tuple[Message, ...]) -> None:
        if self.max_stored <= 0:
            return
        self._expire()
        self._items[response["id"]] = Stored(response, messages, self.clock() + self.ttl_s)
        while len(self._items) > self.max_stored:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            key, first = next(iter(self._items.items()))
            if first.expires > now:
                return
            del self._items[key]
