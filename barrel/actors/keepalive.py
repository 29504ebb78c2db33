"""Keepalive: how many requests each loaded model is serving, and when it may go.

The unload timer arms only when a model's active count reaches zero, so no model is
unloaded in the middle of a request; when the timer fires the count is checked again in
this actor (a request may have started since). keep_alive: seconds, negative = forever,
0 = unload now (the caller unloads and waits for it). An unload asked for while requests
run (`drain`) makes the model expire now: it unloads when the last of them ends, and no
request's own keep_alive takes that back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from barrel.actors.child import Child, Exit, Link
from barrel.actors.registry import Registry
from barrel.actors.timers import Timer, Timers


@dataclass
class Activity:
    """One model's requests in flight and when it may go."""

    active: int = 0
    last_active: float = 0.0  # time.time() of the last release
    keep_alive: float = 300.0
    expires_at: float | None = None  # time.time(); None while active or kept forever
    generation: int = 0
    timer: Timer | None = None
    draining: bool = False  # an unload was asked for: it comes when the last request ends


@dataclass(frozen=True)
class _Expire:
    model: str
    generation: int


@dataclass(frozen=True)
class UnloadIdle:
    """Keepalive -> loader: this model's keep-alive ran out."""

    model: str


@dataclass(frozen=True)
class Forget:
    """Loader -> keepalive: this model is no longer loaded."""

    model: str


class Keepalive(Child):
    def __init__(
        self, link: Link, registry: Registry, timers: Timers, default_keep_alive: float, loader: str
    ) -> None:
        super().__init__(link)
        self.registry = registry
        self.timers = timers
        self.default = default_keep_alive
        self.loader = loader
        self._models: dict[str, Activity] = {}

    def acquire(self, model: str) -> None:
        a = self._models.setdefault(model, Activity(keep_alive=self.default))
        a.active += 1
        a.generation += 1
        if not a.draining:
            a.expires_at = None
        if a.timer is not None:
            a.timer.cancel()
            a.timer = None

    def release(self, model: str, keep_alive: float | None) -> bool:
        """Returns True when the model should be unloaded now (keep_alive 0 and idle)."""
        a = self._models.setdefault(model, Activity(keep_alive=self.default))
        a.active = max(0, a.active - 1)
        a.last_active = time.time()
        if keep_alive is not None and not a.draining:
            a.keep_alive = keep_alive
        if a.active > 0:
            return False
        a.generation += 1
        if a.keep_alive == 0:
            a.draining = False  # the caller unloads it now
            return True
        self._arm(model, a)
        return False

    def drain(self, model: str) -> bool:
        """keep_alive 0 without a request (Ollama's unload): True if the model is idle
        now (the caller unloads it); otherwise it drains: it expires now, and its last
        request's release says to unload it."""
        a = self._models.get(model)
        if a is None:
            return True
        a.keep_alive = 0
        if a.timer is not None:
            a.timer.cancel()
            a.timer = None
        if a.active == 0:
            a.expires_at = None
            return True
        a.draining = True
        a.expires_at = time.time()
        return False

    def loaded(self, model: str, keep_alive: float | None) -> None:
        """A model finished loading (possibly with no request: a preload)."""
        a = self._models.setdefault(model, Activity(keep_alive=self.default))
        if keep_alive is not None:
            a.keep_alive = keep_alive
        if a.active == 0 and a.timer is None:
            a.last_active = time.time()
            a.generation += 1
            self._arm(model, a)

    def _arm(self, model: str, a: Activity) -> None:
        """Start the unload timer of an idle model (none for a negative keep_alive)."""
        if a.keep_alive > 0:
            a.expires_at = a.last_active + a.keep_alive
            a.timer = self.timers.send_after(
                a.keep_alive, self.actor_ref, _Expire(model, a.generation)
            )

    def forget(self, model: str) -> None:
        """The model is no longer loaded: its timer goes. Requests that already count
        as active wait for the next load and keep their count, or an unload asked for
        meanwhile (keep_alive 0) would take that load away from them too."""
        a = self._models.get(model)
        if a is None:
            return
        if a.timer is not None:
            a.timer.cancel()
            a.timer = None
        if a.active > 0:
            a.keep_alive, a.expires_at, a.draining = self.default, None, False
            return
        del self._models[model]

    def snapshot(self) -> dict[str, Activity]:
        return {
            k: Activity(v.active, v.last_active, v.keep_alive, v.expires_at, draining=v.draining)
            for k, v in self._models.items()
        }

    def idle_lru(self) -> list[str]:
        """Idle models, least recently active first."""
        idle = [(a.last_active, m) for m, a in self._models.items() if a.active == 0]
        return [m for _, m in sorted(idle)]

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Forget):
            self.forget(message.model)
            return None
        if isinstance(message, _Expire):
            a = self._models.get(message.model)
            # Re-check here: a request may have come and gone since the timer was armed.
            if a is not None and a.generation == message.generation and a.active == 0:
                a.timer = None
                ref = self.registry.whereis(self.loader)
                if ref is not None:
                    ref.tell(UnloadIdle(message.model))
            return None
        return super().on_receive(message)

    def terminate(self, reason: Exit) -> None:
        for a in self._models.values():
            if a.timer is not None:
                a.timer.cancel()
