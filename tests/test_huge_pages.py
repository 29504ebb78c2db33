"""The huge_pages weight residency: weights read into anonymous memory and moved into
transparent huge pages while the model serves (barrel.engine.hugepages)."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import threading
from functools import partial
from pathlib import Path

import pytest

from barrel.actors import bridge
from barrel.actors.engine_worker import EngineWorker
from barrel.actors.loader import model_options_for
from barrel.actors.registry import Registry
from barrel.actors.supervisor import (
    ChildSpec,
    Strategy,
    SupervisorEnv,
    SupFlags,
    start_root,
    supervisor_spec,
)
from barrel.engine import hugepages
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LoadMode, ModelOptions
from barrel.engine.residency import ResidencyTracker
from barrel.engine.types import GenerationRequest

MiB = 1 << 20
needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")


def huge_bytes(regions: list[tuple[int, int]]) -> int:
    """AnonHugePages of this process's mappings that lie inside `regions`."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(a <= start and end <= b for a, b in regions)
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


class Holder:
    """What a Collapser holds while it works (a LlamaModel in the daemon)."""

    def __init__(self, alive: bool = True) -> None:
        self.alive = alive
        self.holds = 0
        self.lock = threading.Lock()

    def retain(self) -> bool:
        with self.lock:
            if self.alive:
                self.holds += 1
            return self.alive

    def release(self) -> None:
        with self.lock:
            self.holds -= 1


def touched(size: int) -> tuple[mmap.mmap, tuple[int, int]]:
    """A private anonymous mapping, every page written (in small pages: not marked)."""
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.write(b"\x01" * size)
    start = ctypes.addressof(ctypes.c_char.from_buffer(area))
    return area, (start, start + size)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 4 * MiB, [(0, 4 * MiB)]),  # aligned both ends
        (4096, 4 * MiB, [(2 * MiB, 2 * MiB)]),  # the unaligned head stays small
        (0, 4 * MiB + 4096, [(0, 4 * MiB)]),  # and so does the tail
        (4096, 2 * MiB + 4096, []),  # no whole huge page inside
        (0, 80 * MiB, [(0, 32 * MiB), (32 * MiB, 32 * MiB), (64 * MiB, 16 * MiB)]),
    ],
)
def test_slices_are_whole_aligned_huge_pages_32_mib_at_most(
    start: int, end: int, expected: list[tuple[int, int]]
) -> None:
    assert hugepages.slices(start, end) == expected


def test_available_reads_the_systems_setting(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not hugepages.available(setting)
    setting.write_text("always [madvise] never\n")
    assert hugepages.available(setting)
    assert not hugepages.available(tmp_path / "missing")


def test_new_regions_finds_a_mapping_made_in_between() -> None:
    before = hugepages.anonymous_regions()
    area, (start, end) = touched(8 * MiB)
    try:
        found = hugepages.new_regions(before, hugepages.anonymous_regions())
        assert any(a <= start and end <= b for a, b in found)
        assert all(b - a >= hugepages.HUGE for a, b in found)
    finally:
        area.close()


@needs_thp
def test_a_collapser_moves_a_region_into_huge_pages_then_lets_go() -> None:
    area, region = touched(64 * MiB)
    try:
        assert huge_bytes([region]) == 0, "in small pages before"
        owner = Holder()
        collapser = hugepages.Collapser(owner, [region], "test").start()
        assert collapser.done.wait(60)
        assert collapser.collapsed == 64 * MiB
        assert huge_bytes([region]) >= 60 * MiB  # the pages now are 2 MiB ones
        assert owner.holds == 0
        assert area[:4] == b"\x01" * 4, "contents kept"
        assert area[-4:] == b"\x01" * 4
    finally:
        area.close()


def test_a_collapser_leaves_freed_memory_alone_and_stops_when_asked() -> None:
    area, region = touched(4 * MiB)
    try:
        gone = hugepages.Collapser(Holder(alive=False), [region], "freed").start()
        assert gone.done.is_set()
        assert gone.collapsed == 0
        owner = Holder()
        stopped = hugepages.Collapser(owner, [region], "stopped")
        stopped._stop.set()  # asked to stop before its first slice
        stopped.start()
        assert stopped.done.wait(10)
        assert stopped.collapsed == 0
        assert owner.holds == 0, "the hold is given back"
    finally:
        area.close()


def test_huge_pages_loads_into_anonymous_memory_unless_mmap_is_asked_for() -> None:
    huge = LoadMode.NONE if hugepages.available() else LoadMode.MMAP
    assert model_options_for({}, residency="huge_pages").load_mode is huge
    assert model_options_for({"weight_residency": "huge_pages"}).load_mode is huge
    assert model_options_for({}, residency="eager").load_mode is LoadMode.MMAP
    explicit = {"weight_residency": "huge_pages", "use_mmap": True}
    assert model_options_for(explicit).load_mode is LoadMode.MMAP
    assert model_options_for({}, residency="pinned").load_mode is LoadMode.MMAP_MLOCK


def test_the_tracker_counts_held_weights_as_resident(tmp_path: Path) -> None:
    tracker = ResidencyTracker()
    tracker.register("held", tmp_path / "not-mapped.gguf", held=123)
    tracker.register("mapped", tmp_path / "never-mapped.gguf")
    assert tracker.resident() == {"held": 123, "mapped": 0}
    tracker.register("held", tmp_path / "not-mapped.gguf")  # reloaded, mapped this time
    assert tracker.resident()["held"] == 0


async def engine_of(registry: Registry, name: str) -> Engine:
    ref = await asyncio.to_thread(registry.wait_for, name, timeout=10)
    fut = await bridge.call(ref, EngineWorker.engine_future)
    return await asyncio.wait_for(asyncio.wrap_future(fut), 60)


@needs_thp
@pytest.mark.real_model
async def test_weights_in_huge_pages_answer_as_the_mapped_file_does(qwen_path: Path) -> None:
    tracker = ResidencyTracker()
    size = await asyncio.to_thread(lambda: qwen_path.stat().st_size)

    def worker(residency: str, mode: LoadMode) -> ChildSpec:
        return ChildSpec(
            residency,
            partial(
                EngineWorker.start,
                path=qwen_path,
                options=EngineOptions(n_ctx=512, n_seq_max=1),
                model_options=ModelOptions(load_mode=mode),
                residency=residency,
                tracker=tracker,
            ),
        )

    registry = Registry()
    root = start_root(
        supervisor_spec(
            "root",
            SupFlags(Strategy.ONE_FOR_ONE, 1, 10),
            [worker("huge_pages", LoadMode.NONE), worker("eager", LoadMode.MMAP)],
            SupervisorEnv(registry),
        ),
        registry,
        lambda reason: None,
    )
    try:
        huge, mapped = await engine_of(registry, "huge_pages"), await engine_of(registry, "eager")
        collapser = await asyncio.to_thread(
            lambda: registry.get("huge_pages").proxy().collapser.get(timeout=10)
        )
        assert collapser is not None, "read into anonymous memory, to be collapsed"
        assert collapser.total >= 0.9 * size, "the weight buffer found"
        assert await asyncio.to_thread(collapser.done.wait, 120)
        assert huge_bytes(collapser.regions) >= 0.9 * size
        assert tracker.resident()["huge_pages"] == size

        prompt = huge.tokenize("def fibonacci(n):")
        answers = []
        for engine in (huge, mapped):
            deltas, done = await engine.submit(GenerationRequest(prompt, max_tokens=24)).collect()
            assert done.usage.completion_tokens == 24
            answers.append("".join(d.text for d in deltas))
        assert answers[0] == answers[1], "the same weights, greedy: the same answer"
    finally:
        await asyncio.to_thread(root.stop, block=True, timeout=30)
