"""An engine under supervision: a crash fails what is in flight, then it comes back."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from barrel.actors import bridge
from barrel.actors.engine_worker import EngineWorker
from barrel.actors.registry import Registry
from barrel.actors.supervisor import (
    ChildSpec,
    Strategy,
    SupervisorEnv,
    SupFlags,
    start_root,
    supervisor_spec,
)
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.errors import EngineCrashed
from barrel.engine.types import EngineRequest, FinishReason


async def engine_of(registry: Registry, name: str) -> Engine:
    ref = await asyncio.to_thread(registry.wait_for, name, timeout=10)
    fut = await bridge.call(ref, EngineWorker.engine_future)
    return await asyncio.wait_for(asyncio.wrap_future(fut), 30)


async def test_crash_fails_in_flight_requests_and_the_next_one_succeeds(tiny_path: Path) -> None:
    registry = Registry()
    env = SupervisorEnv(registry)
    worker = ChildSpec(
        "tiny",
        partial(EngineWorker.start, path=tiny_path, options=EngineOptions(n_ctx=1024, n_seq_max=2)),
    )
    root = start_root(
        supervisor_spec("root", SupFlags(Strategy.ONE_FOR_ONE, 3, 10), [worker], env),
        registry,
        lambda reason: None,
    )
    try:
        engine = await engine_of(registry, "tiny")
        old_worker = registry.get("tiny")
        prompt = engine.tokenize("Hello world")
        streams = [engine.submit(EngineRequest(prompt, max_tokens=5000)) for _ in range(3)]
        await anext(streams[0])
        engine.inject_fault(RuntimeError("injected fault"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        for s in streams:
            with pytest.raises(EngineCrashed, match="injected fault"):
                await asyncio.wait_for(s.collect(), 2)
        assert loop.time() - start < 2

        # the worker crashed with its engine and was restarted with a fresh one
        new_worker = await asyncio.to_thread(
            registry.wait_for, "tiny", other_than=old_worker, timeout=10
        )
        assert not old_worker.is_alive()
        fresh = await engine_of(registry, "tiny")
        assert fresh is not engine
        _deltas, done = await fresh.submit(EngineRequest(prompt, max_tokens=10)).collect()
        assert done.finish_reason is FinishReason.LENGTH
        assert done.usage.completion_tokens == 10
        assert new_worker.is_alive()
    finally:
        root.stop(block=True, timeout=10)
