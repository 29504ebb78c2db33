"""The evictor: under sustained memory pressure, unload the least recently active idle
model, one per tick, never one with requests in flight.

Every `interval` seconds it compares available memory (barrel.actors.memory) with the
watermark; below it, it names the idle model that was active longest ago to the loader
(`UnloadIdle`, which the loader re-checks with keepalive before acting).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from barrel.actors.bridge import call_sync
from barrel.actors.child import Child, Exit, Link
from barrel.actors.keepalive import Keepalive, UnloadIdle
from barrel.actors.loader import Loader
from barrel.actors.memory import available_bytes
from barrel.actors.registry import Registry
from barrel.actors.timers import Timer, Timers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Tick:
    pass


class Evictor(Child):
    def __init__(
        self,
        link: Link,
        registry: Registry,
        timers: Timers,
        watermark: int,
        interval: float,
        budget: int,
        keepalive: str,
        loader: str,
    ) -> None:
        super().__init__(link)
        self.registry = registry
        self.timers = timers
        self.watermark = watermark
        self.interval = interval
        self.budget = budget
        self.keepalive = keepalive
        self.loader = loader
        self._timer: Timer | None = None
        self.evictions = 0

    def init(self) -> None:
        if self.watermark > 0:
            self._timer = self.timers.interval(self.interval, self.actor_ref, _Tick())

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Tick):
            self._tick()
            return None
        return super().on_receive(message)

    def _tick(self) -> None:
        free = available_bytes(self.budget)
        if free >= self.watermark:
            return
        keepalive, loader = (
            self.registry.whereis(self.keepalive),
            self.registry.whereis(self.loader),
        )
        if keepalive is None or loader is None:
            return
        idle: list[str] = call_sync(keepalive, Keepalive.idle_lru)
        loaded = call_sync(loader, Loader.loaded)
        victim = next((m for m in idle if m in loaded), None)
        if victim is not None:
            logger.warning(
                "memory pressure (%d MiB free < %d MiB): unloading idle model %s",
                free >> 20,
                self.watermark >> 20,
                victim,
            )
            self.evictions += 1
            loader.tell(UnloadIdle(victim))

    def terminate(self, reason: Exit) -> None:
        if self._timer is not None:
            self._timer.cancel()
