"""Timers over an injectable clock, and the name registry."""

from __future__ import annotations

import threading
from typing import Any

import pykka
import pytest

from barrel.actors.child import Child, Link
from barrel.actors.registry import Registry
from barrel.actors.timers import ManualClock, Timers
from barrel.errors import Unavailable


class Inbox(Child):
    """Records every message it is told."""

    def __init__(self, link: Link) -> None:
        super().__init__(link)
        self.got: list[Any] = []
        self.cond = threading.Condition()

    def on_receive(self, message: Any) -> None:
        with self.cond:
            self.got.append(message)
            self.cond.notify_all()

    def received(self) -> list[Any]:
        return list(self.got)


def start_inbox(name: str = "inbox") -> pykka.ActorRef[Any]:
    link = Link(name, on_exit=lambda _urn, _reason: None)
    ref = Inbox.start(link)
    link.started.result(timeout=5)
    return ref


def received(ref: pykka.ActorRef[Any]) -> list[Any]:
    result: list[Any] = ref.proxy().received().get(timeout=5)
    return result


def test_send_after_fires_only_when_the_clock_reaches_it() -> None:
    clock = ManualClock()
    timers = Timers(clock)
    ref = start_inbox()
    timers.send_after(10, ref, "late")
    timers.send_after(5, ref, "early")
    clock.advance(4.9)
    assert received(ref) == []
    clock.advance(0.1)
    assert received(ref) == ["early"]
    clock.advance(5)
    assert received(ref) == ["early", "late"]
    assert timers.pending() == 0


def test_interval_ticks_until_cancelled_and_skips_missed_ticks() -> None:
    clock = ManualClock()
    timers = Timers(clock)
    ref = start_inbox()
    tick = timers.interval(2, ref, "tick")
    clock.advance(2)
    clock.advance(2)
    assert received(ref) == ["tick", "tick"]
    clock.advance(7)  # late by several periods: one tick, not a burst of replays
    assert received(ref) == ["tick"] * 3
    tick.cancel()
    clock.advance(10)
    assert received(ref) == ["tick"] * 3
    assert timers.pending() == 0


def test_timer_to_a_dead_actor_cancels_itself() -> None:
    clock = ManualClock()
    timers = Timers(clock)
    ref = start_inbox()
    tick = timers.interval(1, ref, "tick")
    ref.stop(block=True, timeout=5)
    clock.advance(1)
    assert tick.cancelled
    assert timers.pending() == 0


def test_system_clock_timer_fires_from_its_own_thread() -> None:
    timers = Timers()
    try:
        ref = start_inbox()
        inbox = ref.proxy()
        timers.send_after(0.05, ref, "hello")
        cond: threading.Condition = inbox.cond.get(timeout=5)
        with cond:
            assert cond.wait_for(lambda: inbox.got.get(timeout=5) == ["hello"], timeout=5)
    finally:
        timers.stop()
    with pytest.raises(RuntimeError):
        timers.send_after(1, ref, "after stop")


def test_registry_tracks_live_refs_and_down_children() -> None:
    registry = Registry()
    ref = start_inbox("a")
    registry.register("a", ref, supervisor="root")
    assert registry.get("a") is ref
    other = start_inbox("a2")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a", other, supervisor="root")
    registry.mark_down("a", "restarting", "crash: boom")
    assert registry.whereis("a") is None
    with pytest.raises(Unavailable, match="a is not running"):
        registry.get("a")
    (entry,) = registry.entries()
    assert (entry.state, entry.reason, entry.supervisor) == ("restarting", "crash: boom", "root")
    registry.register("a", other, supervisor="root")
    assert registry.get("a") is other
    other.stop(block=True, timeout=5)
    assert registry.whereis("a") is None, "a dead ref is never handed out"


def test_registry_wait_for_sees_a_restart() -> None:
    registry = Registry()
    old = start_inbox("a")
    registry.register("a", old, supervisor="root")
    new = start_inbox("a-new")
    old.stop(block=True, timeout=5)
    threading.Timer(0.05, registry.register, args=("a", new, "root")).start()
    assert registry.wait_for("a", other_than=old, timeout=5) is new
    with pytest.raises(Unavailable, match="did not come up"):
        registry.wait_for("a", other_than=new, timeout=0.05)


def test_registry_monitor_hears_the_end_once_and_not_a_restart() -> None:
    registry = Registry()
    heard: list[tuple[str, str]] = []
    for name in ("a", "b"):
        registry.register(name, start_inbox(name), supervisor="root")
        registry.monitor(name, lambda why, name=name: heard.append((name, why)))
    registry.mark_down("a", "restarting", "crash: boom")
    assert heard == [], "a restart is not an end"
    registry.register("a", start_inbox("a-again"), supervisor="root")
    registry.unregister("a", "crash: too many restarts")
    registry.mark_down("b", "failed", "restart intensity reached")
    registry.unregister("a")
    assert heard == [("a", "crash: too many restarts"), ("b", "restart intensity reached")]
    registry.monitor("b", lambda why: heard.append(("b again", why)))  # already failed
    registry.monitor("gone", lambda why: heard.append(("gone", why)))  # never there
    assert heard[2:] == [("b again", "restart intensity reached"), ("gone", "")]
