"""Model lifecycle on the tiny model: FIFO admission, keep-alive, memory-aware loading,
crash recovery, /api/ps. The daemon's own actor tree, in process."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from barrel import heap
from barrel.actors.admission import QueueFull
from barrel.actors.lifecycle import Lease, Lifecycle
from barrel.actors.loader import ModelSpec, fit
from barrel.actors.memory import ModelWouldOOM, available_bytes, kv_cache_bytes
from barrel.actors.timers import ManualClock
from barrel.config import Config
from barrel.engine import engine as engine_module
from barrel.engine.context import EngineOptions
from barrel.engine.errors import EngineCrashed
from barrel.engine.types import EngineRequest, FinishReason
from barrel.errors import BarrelError
from barrel.http import errors
from barrel.store.gguf_meta import read_gguf
from tests.apps import app_for, services_of

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


async def start(
    aiohttp_client: MakeClient,
    tmp_path: Path,
    local: dict[str, Path],
    clock: ManualClock | None = None,
    **models: Any,
) -> tuple[Client, Lifecycle]:
    defaults = {"num_seq_max": 2, "queue_depth": 4, **models.pop("defaults", {})}
    config = msgspec.convert(
        {
            "models": {
                "cache_root": str(tmp_path / "cache"),
                "max_context_size": 1024,
                "local": {k: str(v) for k, v in local.items()},
                "defaults": defaults,
                **models,
            }
        },
        Config,
    )
    client = await aiohttp_client(app_for(config, clock=clock))
    await asyncio.to_thread(services_of(client.server.app).runtime.booted.wait, 10)
    return client, services_of(client.server.app).models.lifecycle


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def loaded(lc: Lifecycle) -> set[str]:
    return {m.name for m in await lc.ps()}


async def test_fifo_queue_admits_two_queues_four_and_refuses_two(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    await lc.release(await lc.acquire("tiny"))  # loaded: what follows is about the queue
    admitted: list[int] = []
    positions: dict[int, list[int]] = {}

    async def request(i: int) -> Lease | BaseException:
        try:
            lease = await lc.acquire(
                "tiny", on_queued=lambda p, i=i: positions.setdefault(i, []).append(p)
            )
        except QueueFull as exc:
            return exc
        admitted.append(i)
        return lease

    tasks = []
    for i in range(8):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0.05)  # arrive in order

    def refusals() -> list[QueueFull]:
        return [t.result() for t in tasks if t.done() and isinstance(t.result(), QueueFull)]

    await until(lambda: len(admitted) == 2 and len(refusals()) == 2)
    await asyncio.sleep(0.2)
    assert admitted == [0, 1], "two run at once"
    refused = refusals()
    assert [i for i, t in enumerate(tasks) if t.done() and isinstance(t.result(), QueueFull)] == [
        6,
        7,
    ]
    resp = errors.render("/api/chat", refused[0])
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "2"
    assert errors.render("/v1/messages", refused[0]).status == 529
    assert [positions[i][0] for i in range(2, 6)] == [1, 2, 3, 4], "queue positions are visible"
    ps = await lc.ps()
    assert (ps[0].running, ps[0].queued) == (2, 4)
    # releasing admits the waiters in arrival order
    leases = {i: t.result() for i, t in enumerate(tasks) if i in admitted}
    order: list[int] = []
    while len(order) < 4:
        i = next(iter(leases))
        await lc.release(leases.pop(i))
        await until(lambda: len(admitted) > 2 + len(order))
        j = admitted[2 + len(order)]
        order.append(j)
        leases[j] = await tasks[j]  # type: ignore[assignment]
    assert order == [2, 3, 4, 5]
    for lease in leases.values():
        await lc.release(lease)


async def test_a_place_freed_while_a_request_queues_is_taken_in_the_next_step(
    aiohttp_client: MakeClient,
    tmp_path: Path,
    tiny_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    decoded: list[list[tuple[int, int, int]]],
) -> None:
    """Two places, a long answer and a short one running, a third request queued: when the
    short one ends, the engine's next step reads the queued request's prompt beside the
    long answer (it waits the few ms the daemon takes to admit it) instead of running
    with the place empty."""
    # the wait ends when the request arrives; its bound (a step's time) only as a safety net
    monkeypatch.setattr(engine_module, "HANDOFF_MIN_S", 60.0)
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    long, short = await lc.acquire("tiny"), await lc.acquire("tiny")
    engine = long.engine
    queued = asyncio.Event()
    third = asyncio.create_task(lc.acquire("tiny", on_queued=lambda _: queued.set()))
    await queued.wait()
    story = engine.tokenize("Once upon a time")
    running = engine.submit(EngineRequest(story, max_tokens=900, ignore_eos=True))
    reading = asyncio.create_task(running.collect())  # read: a stream nobody reads pauses
    prompt = engine.tokenize("def main():")
    request = EngineRequest(prompt, max_tokens=3, ignore_eos=True)
    _, done = await engine.submit(request).collect()
    # a slow hand-off (a busy event loop): without the wait the long answer steps on alone
    await asyncio.sleep(0.2)
    await lc.release(short)
    lease = await third
    later = engine.tokenize(" ".join(f"item {k} costs {k * 3}" for k in range(20)))
    request = EngineRequest(later, max_tokens=2, ignore_eos=True)
    _, after = await lease.engine.submit(request).collect()
    await lc.release(lease)
    running.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await lc.release(long)
    assert len(done.tokens) == 3
    assert len(after.tokens) == 2

    def seq_of(tokens: list[int]) -> int:
        last = (tokens[-1], len(tokens) - 1)
        return next(q for rows in decoded for q, t, p in rows if (t, p) == last)

    story_seq, short_seq = seq_of(story), seq_of(prompt)
    answered = [(short_seq, t, len(prompt) + j) for j, t in enumerate(done.tokens)]
    ended = max(i for i, rows in enumerate(decoded) if set(rows) & set(answered))
    following = decoded[ended + 1]
    assert any(q == story_seq for q, _, _ in following), "the long answer had ended"
    read = [p for q, t, p in following if q != story_seq and p < len(later) and later[p] == t]
    assert read, "the step after the short answer ended ran without the queued request"


async def test_a_waiting_request_that_gives_up_leaves_the_queue(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path}, defaults={"num_seq_max": 1})
    first = await lc.acquire("tiny")
    waiting = asyncio.create_task(lc.acquire("tiny"))
    await asyncio.sleep(0.2)
    waiting.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await lc.release(first)
    second = await asyncio.wait_for(lc.acquire("tiny"), 10)  # not stuck behind a ghost
    await lc.release(second)


async def test_keep_alive_zero_unloads_before_answering(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    lease = await lc.acquire("tiny")
    assert await loaded(lc) == {"tiny"}
    await lc.release(lease, keep_alive=0)
    assert await loaded(lc) == set()
    assert not lease.engine.alive


async def test_keep_alive_counts_from_the_end_of_the_last_request(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    clock = ManualClock()
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path}, clock=clock)
    lease = await lc.acquire("tiny", keep_alive=1.0)
    prompt = lease.engine.tokenize("Hello")
    async for _ in lease.engine.submit(EngineRequest(prompt, max_tokens=4)):
        clock.advance(5.0)  # a request that lasts past the keep-alive
    assert await loaded(lc) == {"tiny"}, "never unloaded during a request"
    await lc.release(lease, keep_alive=1.0)
    clock.advance(0.9)
    assert await loaded(lc) == {"tiny"}  # (the timer fires in advance's own thread)
    clock.advance(0.2)
    while await loaded(lc):  # noqa: ASYNC110 (the loader is asked: no event to wait on)
        await asyncio.sleep(0.02)  # the unload the timer asked for, as it happens


async def test_memory_budget_unloads_the_idle_model_and_refuses_when_busy(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    size = await asyncio.to_thread(os.path.getsize, tiny_path)
    budget = int(size * 1.6)  # one model and its (small) KV cache fit, two do not
    _, lc = await start(
        aiohttp_client,
        tmp_path,
        {"a": tiny_path, "b": other},
        memory_aware_loading=True,
        memory_budget_bytes=budget,
        model_load_memory_margin_b=1 << 20,
    )
    lease = await lc.acquire("a")
    await lc.release(lease)
    assert await loaded(lc) == {"a"}
    lease_b = await lc.acquire("b")  # a is idle: it goes to make room
    assert await loaded(lc) == {"b"}
    with pytest.raises(ModelWouldOOM) as info:
        await lc.acquire("a")  # b is busy: nothing can go
    assert info.value.status == 503
    assert info.value.code == "model_would_oom"
    await lc.release(lease_b)


async def test_engine_crash_mid_stream_then_the_model_serves_again(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    _, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path, "bystander": other})
    bystander = await lc.acquire("bystander")
    lease = await lc.acquire("tiny")
    stream = lease.engine.submit(EngineRequest(lease.engine.tokenize("Hi"), max_tokens=5000))
    await anext(stream)
    lease.engine.inject_fault(RuntimeError("engine thread killed"))
    with pytest.raises(EngineCrashed):
        await asyncio.wait_for(stream.collect(), 5)
    await lc.release(lease)
    deadline = time.monotonic() + 20
    while True:
        again = await lc.acquire("tiny")
        if again.engine.alive and again.engine is not lease.engine:
            break
        await lc.release(again)
        assert time.monotonic() < deadline, "the model never came back"
        await asyncio.sleep(0.1)
    _, done = await again.engine.submit(
        EngineRequest(again.engine.tokenize("Hi"), max_tokens=5)
    ).collect()
    assert done.finish_reason is FinishReason.LENGTH
    await lc.release(again)
    assert bystander.engine.alive, "the other model was not touched"
    _, done = await bystander.engine.submit(EngineRequest([1, 2, 3], max_tokens=3)).collect()
    assert done.usage.completion_tokens == 3
    await lc.release(bystander)


async def test_api_ps(aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path) -> None:
    from tests.contract.spec import validator

    running_model = validator("components", "schemas", "RunningModel")
    client, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    assert (await (await client.get("/api/ps")).json()) == {"models": []}
    lease = await lc.acquire("tiny", keep_alive=60)
    body = await (await client.get("/api/ps")).json()
    (model,) = body["models"]
    assert model["name"] == "tiny"
    assert model["context_length"] == 1024
    assert (model["active"], model["running"], model["queued"]) == (1, 1, 0)
    assert model["expires_at"] is None, "no expiry while active"
    running_model.validate(model)  # as openapi.yaml documents it
    file_size = await asyncio.to_thread(os.path.getsize, tiny_path)
    assert model["size"] > file_size  # the weights and the KV cache
    assert model["size"] < file_size + (64 << 20), "no estimate margin (1 GiB) in it"
    await lc.release(lease, keep_alive=60)
    (model,) = (await (await client.get("/api/ps")).json())["models"]
    assert model["active"] == 0
    assert model["expires_at"] is not None
    running_model.validate(model)


async def test_a_kv_stream_per_sequence_is_counted_in_api_ps(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    """`models.defaults.kv_per_sequence`: the KV cache is allocated once for each
    sequence and the pinned prefix, and /api/ps says so; the model still answers. "auto"
    (the default) is a stream per sequence for a model on the CPU."""
    file_size = await asyncio.to_thread(os.path.getsize, tiny_path)
    kv: dict[bool | str, int] = {}
    for per_sequence in (False, True, "auto"):
        client, lc = await start(
            aiohttp_client,
            tmp_path / str(per_sequence),
            {"tiny": tiny_path},
            defaults={"kv_per_sequence": per_sequence},
        )
        lease = await lc.acquire("tiny", keep_alive=60)
        (model,) = (await (await client.get("/api/ps")).json())["models"]
        assert model["context_length"] == 1024  # a request's context either way
        kv[per_sequence] = model["size"] - file_size
        request = EngineRequest(lease.engine.tokenize("Hi"), max_tokens=3)
        _, done = await lease.engine.submit(request).collect()
        assert done.usage.completion_tokens == 3
        await lc.release(lease)
    assert kv[False] > 0
    assert kv[True] == 3 * kv[False]  # two sequences and a pinned prefix
    assert kv["auto"] == kv[True]


async def test_auto_shares_one_kv_stream_when_a_stream_each_would_not_fit(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    """`kv_per_sequence = "auto"` under memory-aware loading: a stream per sequence only
    where its memory neither refuses the load nor unloads another model; one shared
    stream otherwise, and the model answers either way."""
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    size = await asyncio.to_thread(os.path.getsize, tiny_path)
    margin = 1 << 20
    info = await asyncio.to_thread(read_gguf, tiny_path)
    meta = {"block_count": info.block_count, "head_count": info.head_count}
    meta |= {"head_count_kv": info.head_count_kv, "embedding_length": info.embedding_length}
    kv = kv_cache_bytes(meta, 1024)  # one stream of the context's 1,024 cells

    async def kv_of(budget: int, *names: str) -> list[int]:
        _, lc = await start(
            aiohttp_client,
            tmp_path / f"budget-{budget}",
            {"a": tiny_path, "b": other},
            memory_aware_loading=True,
            memory_budget_bytes=budget,
            model_load_memory_margin_b=margin,
        )
        for name in names:
            lease = await lc.acquire(name)
            request = EngineRequest(lease.engine.tokenize("Hi"), max_tokens=2)
            _, done = await lease.engine.submit(request).collect()
            assert done.usage.completion_tokens == 2
            await lc.release(lease)
        by_name = {m.name: m.size - size for m in await lc.ps()}
        return [by_name[name] for name in names]

    assert await kv_of(size + margin + 3 * kv, "a") == [3 * kv]  # two sequences and a pin
    assert await kv_of(size + margin + 2 * kv, "a") == [kv]  # three streams do not fit
    # b with a stream each would unload a; with one shared stream both stay
    assert await kv_of(2 * (size + margin) + 5 * kv, "a", "b") == [3 * kv, kv]


def test_without_memory_aware_loading_auto_still_shares_what_free_memory_cannot_hold(
    tiny_path: Path,
) -> None:
    """`loader.fit` with no planner: nothing is refused or unloaded, but a stream per
    sequence chosen for speed gives way when it is larger than the memory free now."""
    free = available_bytes()
    opts = EngineOptions(kv_per_sequence=True)
    fits = ModelSpec("m", tiny_path, opts, estimate_bytes=free // 4, per_sequence_extra=8)
    assert fit(fits, None, []) == (fits, [])
    huge = dataclasses.replace(fits, estimate_bytes=free + (1 << 30), per_sequence_extra=1 << 31)
    chosen, victims = fit(huge, None, [])
    assert (chosen.engine.kv_per_sequence, chosen.estimate_bytes, victims) == (
        False,
        free - (1 << 30),
        [],
    )
    asked = dataclasses.replace(huge, per_sequence_extra=0)  # `true`, not "auto": kept
    assert fit(asked, None, []) == (asked, [])


async def test_a_failed_load_gives_every_waiter_the_cause(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    from barrel.store.synthetic import write_small_gguf

    broken = write_small_gguf(tmp_path / "no-weights.gguf")  # a valid header, no model
    client, lc = await start(aiohttp_client, tmp_path, {"broken": broken, "tiny": tiny_path})
    results = await asyncio.gather(
        *(lc.acquire("broken") for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, BarrelError) for r in results), results
    # one load, and every waiter gets its cause (later ones as "model failed: <cause>")
    assert all("llama.cpp could not load" in str(r) for r in results), results
    with pytest.raises(BarrelError):
        await lc.acquire("broken")  # failed, not retried in a loop
    assert (await client.get("/health")).status == 200
    lease = await lc.acquire("tiny")  # the daemon goes on serving
    await lc.release(lease)


async def test_crashes_beyond_the_intensity_mark_the_model_failed(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    config = {
        "cache_root": str(tmp_path / "cache"),
        "max_context_size": 1024,
        "local": {"tiny": str(tiny_path), "other": str(other)},
        "defaults": {"num_seq_max": 2},
    }
    cfg = msgspec.convert(
        {"models": config, "supervision": {"models": {"intensity": 1, "period_s": 60}}}, Config
    )
    client = await aiohttp_client(app_for(cfg))
    await asyncio.to_thread(services_of(client.server.app).runtime.booted.wait, 10)
    lc = services_of(client.server.app).models.lifecycle
    bystander = await lc.acquire("other")
    crashed: list[Any] = []
    for _ in range(10):
        try:
            lease = await lc.acquire("tiny")
        except BarrelError as exc:
            failure = exc
            break
        if lease.engine not in crashed:
            crashed.append(lease.engine)
            lease.engine.inject_fault(RuntimeError("boom"))
        await lc.release(lease)
        await asyncio.sleep(0.3)
    else:
        raise AssertionError("the model never gave up")
    assert failure.status == 503
    assert "failed" in failure.message
    assert len(crashed) == 2, "one restart allowed, the second crash is one too many"
    assert bystander.engine.alive
    _, done = await bystander.engine.submit(EngineRequest([1, 2], max_tokens=2)).collect()
    assert done.usage.completion_tokens == 2
    await lc.release(bystander)


async def test_a_request_waiting_for_a_restart_hears_when_the_supervisor_gives_up_instead(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that finds the engine dead waits for the restarted worker's report; when
    the crash is one too many, the model's supervisor gives up instead and the request
    hears it then (503, model failed), not at its load timeout. The window is held open
    by holding the crashed worker's unload until the request waits."""
    cfg = msgspec.convert(
        {
            "models": {"cache_root": str(tmp_path / "cache"), "local": {"tiny": str(tiny_path)}},
            "supervision": {"models": {"intensity": 1, "period_s": 60}},
        },
        Config,
    )
    client = await aiohttp_client(app_for(cfg))
    await asyncio.to_thread(services_of(client.server.app).runtime.booted.wait, 10)
    lc = services_of(client.server.app).models.lifecycle
    lc.progress_every = 0.05  # on_loading says "waiting for the load" soon
    lease = await lc.acquire("tiny")
    first = lease.engine
    first.inject_fault(RuntimeError("boom"))
    await lc.release(lease)
    assert await asyncio.to_thread(first.join, 30)
    lease = await lc.acquire("tiny")  # the restart's engine (one restart is allowed)
    second = lease.engine
    assert second is not first
    assert second.alive
    waiting = threading.Event()
    monkeypatch.setattr(heap, "trim", lambda: float(waiting.wait(60)))
    second.inject_fault(RuntimeError("boom"))
    await lc.release(lease)
    assert await asyncio.to_thread(second.join, 30)
    with pytest.raises(BarrelError) as failed:
        await asyncio.wait_for(lc.acquire("tiny", on_loading=lambda _s: waiting.set()), 120)
    assert waiting.is_set(), "the request did not wait for the restart"
    assert failed.value.status == 503
    assert "failed" in failed.value.message
    assert "more than 1 restarts" in failed.value.message


@pytest.mark.real_model
async def test_resident_bytes_differ_between_lazy_and_pinned(
    aiohttp_client: MakeClient, tmp_path: Path, qwen_path: Path
) -> None:
    from barrel.engine.residency import drop_page_cache

    async def resident(mode: str) -> tuple[float, float]:
        client, lc = await start(
            aiohttp_client, tmp_path / mode, {"qwen": qwen_path}, weight_residency_default=mode
        )
        await asyncio.to_thread(drop_page_cache, qwen_path)

        async def gauge() -> float:
            text = await (await client.get("/metrics")).text()
            line = next(
                li for li in text.splitlines() if li.startswith("barrel_inference_resident")
            )
            return float(line.split()[-1])

        await lc.preload("qwen")
        after_load = await gauge()
        lease = await lc.acquire("qwen")
        await lease.engine.submit(
            EngineRequest(lease.engine.tokenize("Hi"), max_tokens=2)
        ).collect()
        await lc.release(lease, keep_alive=0)
        await lc.preload("qwen")
        return after_load, await gauge()

    size = await asyncio.to_thread(os.path.getsize, qwen_path)
    # Another process holds every page of the file in the page cache (as another
    # daemon, or another test's, may): the figure is this daemon's own residency.
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLD_PAGES,
        str(qwen_path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert await holder.stdout.readline() == b"held\n"
        lazy_loaded, _ = await resident("lazy")
        pinned_loaded, _ = await resident("pinned")
    finally:
        holder.kill()
        await holder.wait()
    assert lazy_loaded < size * 0.2, "lazy: nothing read ahead"
    assert pinned_loaded > size * 0.9, "pinned: everything in RAM and locked"


HOLD_PAGES = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
total = sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))
print("held", flush=True)
sys.stdin.read()
"""


async def test_evictor_unloads_idle_models_under_pressure_never_busy_ones(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    other = tmp_path / "other.gguf"
    shutil.copy(tiny_path, other)
    # A watermark no machine meets: permanent pressure.
    _, lc = await start(
        aiohttp_client,
        tmp_path,
        {"busy": tiny_path, "idle": other},
        memory_watermark_bytes=1 << 60,
        evictor_interval_s=0.1,
    )
    busy = await lc.acquire("busy", keep_alive=-1)
    await lc.release(await lc.acquire("idle", keep_alive=-1))
    await until(lambda: True)
    deadline = time.monotonic() + 10
    while "idle" in await loaded(lc):
        assert time.monotonic() < deadline, "the idle model was never evicted"
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # several more ticks
    assert await loaded(lc) == {"busy"}, "a model with a request in flight stays"
    _, done = await busy.engine.submit(EngineRequest([1, 2], max_tokens=2)).collect()
    assert done.usage.completion_tokens == 2
    await lc.release(busy)


async def test_load_progress_while_waiting(
    aiohttp_client: MakeClient, tmp_path: Path, qwen_path: Path
) -> None:
    _, lc = await start(aiohttp_client, tmp_path, {"qwen": qwen_path})
    lc.progress_every = 0.01
    seen: list[float] = []
    lease = await lc.acquire("qwen", on_loading=seen.append)
    assert seen, "progress arrived while the model loaded"
    assert seen == sorted(seen)
    await lc.release(lease)
    seen.clear()
    lease = await lc.acquire("qwen", on_loading=seen.append)
    assert seen == [], "no progress for a model already loaded"
    await lc.release(lease)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 300.0), (0, 0.0), (-1, -1.0), (30, 30.0), ("5m", 300.0), ("1h", 3600.0), ("30s", 30.0)],
)
def test_keep_alive_values(value: Any, seconds: float) -> None:
    from barrel.config import keep_alive_seconds

    assert keep_alive_seconds(value, "5m") == seconds


def test_bad_keep_alive() -> None:
    from barrel.config import keep_alive_seconds

    for bad in ("soon", True, "5 minutes"):
        with pytest.raises(ValueError, match=r"keep_alive|duration"):
            keep_alive_seconds(bad, "5m")


async def test_stored_model_parameters_set_context_sequences_and_queue(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    from barrel.actors import bridge
    from barrel.actors.store_actor import StoreActor
    from barrel.store.modelfile import parse

    client, lc = await start(aiohttp_client, tmp_path, {})
    imports = tmp_path / "cache" / "imports"
    await asyncio.to_thread(imports.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread(shutil.copy, tiny_path, imports / "tiny.gguf")
    spec = parse(
        "FROM ./tiny.gguf\nPARAMETER num_ctx 512\nPARAMETER num_seq_max 1\n"
        "PARAMETER queue_depth 1\nPARAMETER weight_residency lazy\n"
    )
    store = services_of(client.server.app).runtime.registry.get("store")
    await bridge.call(store, StoreActor.create, "stored:v1", spec, None, timeout=60)
    first = await lc.acquire("stored:v1")
    assert first.engine.n_ctx == 512
    assert first.spec.residency == "lazy"
    waiting = asyncio.create_task(lc.acquire("stored:v1"))
    await asyncio.sleep(0.2)
    with pytest.raises(QueueFull):
        await lc.acquire("stored:v1")  # one running, one waiting: full
    await lc.release(first)
    await lc.release(await waiting)
