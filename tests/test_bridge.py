"""Asking actors from asyncio: the loop keeps running, every wait has a timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pykka
import pytest

from barrel.actors import bridge
from barrel.actors.child import Link
from barrel.errors import CallTimeout, NotFound, Unavailable
from tests.probes import Probe, Worker


def start_worker() -> pykka.ActorRef[Any]:
    link = Link("w", on_exit=lambda _urn, _reason: None)
    ref = Worker.start(link, Probe())
    link.started.result(timeout=5)
    return ref


async def test_call_returns_the_result() -> None:
    ref = start_worker()
    assert await bridge.call(ref, Worker.echo, {"x": 1}) == {"x": 1}
    assert await asyncio.to_thread(bridge.call_sync, ref, Worker.echo, 5) == 5


async def test_a_bug_in_a_call_reaches_the_caller_and_crashes_the_actor() -> None:
    ref = start_worker()
    with pytest.raises(RuntimeError, match="boom"):
        await bridge.call(ref, Worker.crash)
    await asyncio.to_thread(ref.actor_stopped.wait, 5)
    assert not ref.is_alive()


async def test_loop_keeps_running_while_an_actor_is_busy() -> None:
    ref = start_worker()
    gate = threading.Event()
    call = asyncio.create_task(bridge.call(ref, Worker.block, gate, timeout=10))
    for _ in range(50):
        await asyncio.sleep(0)  # the loop keeps turning: 50 turns while the actor is busy
    assert not call.done()
    gate.set()
    assert await call == "unblocked"


async def test_timeout_raises_call_timeout_naming_the_target() -> None:
    ref = start_worker()
    gate = threading.Event()
    start = time.monotonic()
    with pytest.raises(CallTimeout, match=r"Worker\.block did not answer within 0\.2s"):
        await bridge.call(ref, Worker.block, gate, timeout=0.2)
    assert time.monotonic() - start < 30  # safety net: the block never ends by itself
    gate.set()
    # the late answer is dropped; the actor goes on serving
    assert await bridge.call(ref, Worker.echo, 3) == 3


async def test_typed_errors_reach_the_caller() -> None:
    ref = start_worker()
    with pytest.raises(NotFound, match="no such thing"):
        await bridge.call(ref, Worker.not_found)


async def test_dead_actor_is_unavailable() -> None:
    ref = start_worker()
    ref.stop(block=True, timeout=5)
    with pytest.raises(Unavailable, match="not running"):
        await bridge.call(ref, Worker.echo, 1)


async def test_actor_stopping_with_a_call_queued_answers_unavailable() -> None:
    ref = start_worker()
    gate = threading.Event()
    busy = asyncio.create_task(bridge.call(ref, Worker.block, gate))
    await asyncio.sleep(0)
    ref.stop(block=False)  # the stop waits in the inbox behind `block`...
    queued = asyncio.create_task(bridge.call(ref, Worker.echo, 1))  # ...and `echo` behind it
    await asyncio.sleep(0)
    gate.set()
    assert await busy == "unblocked"
    with pytest.raises(Unavailable, match="stopped before answering"):
        await queued
    assert bridge.IN_FLIGHT.left(ref.actor_urn) == []  # nothing kept of a stopped actor
