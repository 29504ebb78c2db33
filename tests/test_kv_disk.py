"""Conversations that survive their engine: states written to disk as an engine stops
(barrel.engine.kvdisk) and restored by the next engine of the same model when a prompt
extends one. Real llama.cpp, the tiny model; the daemon-level tests (unload, restart,
Qwen) are in tests/test_kv_disk_daemon.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.kvdisk import (
    BLOCK,
    MAGIC,
    SUFFIX,
    TEMP_SUFFIX,
    TOKEN,
    KVDisk,
    Saved,
    SaveTo,
    chain,
    model_states,
)
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, EngineRequest

OPTS = EngineOptions(n_ctx=1024, n_seq_max=2)


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


def _prompt(model: LlamaModel, words: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    text = " ".join(f"w{int(x)}" for x in rng.integers(0, 5000, words))
    return model.tokenize(text)


async def _turn(e: Engine, prompt: list[int], scope: str = "", n: int = 8) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens reused)."""
    req = EngineRequest(prompt, GREEDY, max_tokens=n, scope=scope)
    _, done = await e.submit(req).collect()
    return list(done.tokens), done.usage.prompt_reused


def _engine(model: LlamaModel, disk: KVDisk | None, opts: EngineOptions = OPTS) -> Engine:
    save_to = None if disk is None else SaveTo(disk, "tiny", "sha256:tiny")
    return Engine(model, opts, name="tiny", save_to=save_to).start()


async def test_a_conversation_goes_on_after_its_engine_stops(
    model: LlamaModel, tmp_path: Path
) -> None:
    restored: list[tuple[str, int]] = []
    disk = KVDisk(tmp_path / "kv", 1 << 30, on_restored=lambda m, n: restored.append((m, n)))
    first = _prompt(model, 80, 1)
    warm = _engine(model, disk)
    try:
        answer, _ = await _turn(warm, first)
        follow = first + answer + _prompt(model, 20, 2)
        expected, reused = await _turn(warm, follow)
        assert reused >= len(first)  # the parked sequence, warm
    finally:
        warm.stop()
    usage = disk.usage()
    assert usage["tiny"][0] >= 1
    assert usage["tiny"][1] > 0

    cold = _engine(model, disk)
    try:
        got, reused = await _turn(cold, follow)
    finally:
        cold.stop()
    assert reused == len(follow) - 1  # all but the last prompt token came from disk
    assert got == expected
    assert restored == [("tiny", len(follow) - 1)]

    # without the disk the same turn is prefilled whole, to the same answer
    plain = _engine(model, None)
    try:
        again, reused = await _turn(plain, follow)
    finally:
        plain.stop()
    assert reused == 0
    assert again == expected


async def test_a_state_read_from_disk_never_stops_the_other_sequences(
    model: LlamaModel, tmp_path: Path
) -> None:
    """A saved state's file is read off the engine thread: while it is slow to read (a
    FIFO, written when the test says so), a running sequence keeps decoding; the
    request whose state it is starts once the bytes are in, restored from them."""
    disk = KVDisk(tmp_path / "kv", 1 << 30)
    first = _prompt(model, 80, 7)
    warm = _engine(model, disk)
    try:
        answer, _ = await _turn(warm, first)
    finally:
        warm.stop()
    [path] = list((tmp_path / "kv").glob(f"*{SUFFIX}"))
    content = path.read_bytes()
    e = _engine(model, KVDisk(tmp_path / "kv", 1 << 30))  # its index read from the headers
    path.unlink()
    os.mkfifo(path)  # opening it for reading waits for the test to write it

    def fill() -> None:
        with path.open("wb") as f:
            f.write(content)

    filled: asyncio.Future[None] | None = None
    try:
        other = e.submit(EngineRequest(_prompt(model, 20, 8), GREEDY, max_tokens=300))
        await anext(other)
        follow = [*first, *answer, *_prompt(model, 10, 9)]
        restoring = e.submit(EngineRequest(follow, GREEDY, max_tokens=4))

        async def tokens(n: int) -> int:
            seen = 0
            async for event in other:
                seen += len(getattr(event, "tokens", ()))
                if seen >= n:
                    break
            return seen

        # safety net only: a step that waited for the file would never come
        assert await asyncio.wait_for(tokens(40), 120) >= 40
        assert restoring.backlog == 0  # not admitted while its state is read
        filled = asyncio.ensure_future(asyncio.to_thread(fill))
        _, done = await restoring.collect()
        await filled
        assert done.usage.prompt_reused >= len(first)  # restored from the file
        other.cancel()
    finally:
        if filled is None:  # unblock a reader that waits for the file, whatever failed
            threading.Thread(target=fill, daemon=True).start()
        e.stop()


async def test_another_scope_never_restores_a_state(model: LlamaModel, tmp_path: Path) -> None:
    disk = KVDisk(tmp_path / "kv", 1 << 30)
    prompt = _prompt(model, 80, 3)
    e = _engine(model, disk)
    try:
        await _turn(e, prompt, scope="key-a")
    finally:
        e.stop()
    e = _engine(model, disk)
    try:
        _, other = await _turn(e, prompt, scope="key-b")
        _, own = await _turn(e, prompt, scope="key-a")
    finally:
        e.stop()
    assert other == 0
    assert own == len(prompt) - 1


async def test_a_state_of_other_settings_is_never_found(model: LlamaModel, tmp_path: Path) -> None:
    disk = KVDisk(tmp_path / "kv", 1 << 30)
    prompt = _prompt(model, 80, 4)
    e = _engine(model, disk)
    try:
        await _turn(e, prompt)
    finally:
        e.stop()
    other = EngineOptions(n_ctx=768, n_seq_max=2)  # another context size: another KV
    e = _engine(model, disk, other)
    try:
        _, reused = await _turn(e, prompt)
    finally:
        e.stop()
    assert reused == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
async def test_a_damaged_state_is_removed_and_the_request_answers(
    model: LlamaModel, tmp_path: Path, damage: str
) -> None:
    disk = KVDisk(tmp_path / "kv", 1 << 30)
    prompt = _prompt(model, 80, 5)
    e = _engine(model, disk)
    try:
        expected, _ = await _turn(e, prompt)
    finally:
        e.stop()
    [path] = list((tmp_path / "kv").glob(f"*{SUFFIX}"))
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF  # the checksum no longer matches
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[3:12] = b"not-a-kvs"
    path.write_bytes(bytes(raw))

    fresh = KVDisk(tmp_path / "kv", 1 << 30)  # as after a restart: the index from the files
    e = _engine(model, fresh)
    try:
        got, reused = await _turn(e, prompt)
        gone = not path.exists()  # before the engine stops and writes its states again
    finally:
        e.stop()
    assert reused == 0
    assert got == expected
    assert gone


async def test_another_models_state_is_refused_and_removed(
    model: LlamaModel, qwen_path: Path, tmp_path: Path
) -> None:
    """A file that checks out but holds another model's state (the tiny model's, under
    the header Qwen's engine looks for): llama.cpp refuses it, the file goes, the
    prompt is prefilled."""
    disk = KVDisk(tmp_path / "kv", 1 << 30)
    prompt = _prompt(model, 80, 5)  # the tiny model has Qwen's vocabulary
    e = _engine(model, disk)
    try:
        await _turn(e, prompt)
    finally:
        e.stop()
    qwen = LlamaModel.load(qwen_path)
    try:
        plain = Engine(qwen, OPTS, name="qwen").start()
        try:
            expected, _ = await _turn(plain, prompt)
        finally:
            plain.stop()
        # as after a restart: the index read from the files
        to = SaveTo(KVDisk(tmp_path / "kv", 1 << 30), "qwen", "sha256:qwen")
        [path] = list((tmp_path / "kv").glob(f"*{SUFFIX}"))
        _rewrite_header(path, fingerprint=model_states(to, qwen.path, OPTS, OPTS.n_ctx).fingerprint)
        e = Engine(qwen, OPTS, name="qwen", save_to=to).start()
        try:
            got, reused = await _turn(e, prompt)
            gone = not path.exists()
        finally:
            e.stop()
    finally:
        qwen.free()
    assert reused == 0
    assert got == expected
    assert gone


def _rewrite_header(path: Path, **fields: str) -> None:
    raw = path.read_bytes()
    at = len(MAGIC)
    (n,) = struct.unpack("<I", raw[at : at + 4])
    header = {**json.loads(raw[at + 4 : at + 4 + n]), **fields}
    head = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + raw[at + 4 + n :])


async def test_the_disk_budget_holds_under_distinct_conversations(
    model: LlamaModel, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    probe = KVDisk(root / "probe", 1 << 30)
    e = _engine(model, probe)
    try:
        await _turn(e, _prompt(model, 80, 6))
    finally:
        e.stop()
    one = probe.used_bytes
    assert one > 0
    budget = int(one * 2.5)  # room for two states, never three
    disk = KVDisk(root / "budget", budget)
    seen: list[int] = []
    for seed in range(5):
        e = _engine(model, disk)
        try:
            await _turn(e, _prompt(model, 80, 10 + seed))
        finally:
            e.stop()
        on_disk = sum(p.stat().st_size for p in (root / "budget").iterdir())
        seen.append(on_disk)
        assert on_disk <= budget
    assert len(list((root / "budget").glob(f"*{SUFFIX}"))) == 2
    # the newest conversation is kept, the oldest went first
    e = _engine(model, disk)
    try:
        _, newest = await _turn(e, _prompt(model, 80, 14))
        _, oldest = await _turn(e, _prompt(model, 80, 10))
    finally:
        e.stop()
    assert newest > BLOCK
    assert oldest < BLOCK


def test_a_state_extending_another_replaces_it(tmp_path: Path) -> None:
    disk = KVDisk(tmp_path, 1 << 30)
    image = -1 - (2**62 + 12345)  # an image's placeholder: 63 bits (barrel.engine.projector)
    short = (image, *range(BLOCK * 2 - 1))
    long = (*short, *range(1000, 1000 + BLOCK))
    assert disk.write("m", "fp", "b", Saved("", short, b"s" * 100))
    assert disk.write("m", "fp", "b", Saved("", long, b"l" * 100))
    assert not disk.write("m", "fp", "b", Saved("", short, b"s" * 100))  # a prefix of one kept
    assert disk.usage()["m"][0] == 1
    found = disk.best("fp", "", [*short, 7, 7], 0)
    assert found is not None
    assert found[1] == len(short)
    assert len(chain(np.asarray(long, dtype=TOKEN))) == 3


_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from barrel.engine.kvdisk import KVDisk, Saved
    disk = KVDisk(Path(sys.argv[1]), 1 << 40)
    i = 0
    while True:
        i += 1
        disk.write("m", "fp", "b", Saved("", tuple(range(i, i + 512)), bytes(64 << 20)))
        print(i, flush=True)
    """
)


def test_a_kill_during_a_write_leaves_nothing_to_trip_on(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "1"  # one state written whole
        # killed while the next ones are written: a temp file is there or soon will be
        for _ in range(3):
            if any(p.name.endswith(TEMP_SUFFIX) for p in root.iterdir()):
                break
            proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    # a torn file under the final name (the rename is atomic, but a power cut is not)
    whole = sorted(root.glob(f"*{SUFFIX}"))
    assert whole
    torn = whole[0].with_name("f" * 40 + SUFFIX)
    torn.write_bytes(whole[0].read_bytes()[:1000])

    disk = KVDisk(root, 1 << 40)
    usage = disk.usage()
    assert usage["m"][0] == len(whole)  # every whole state, nothing else
    assert not any(p.name.endswith(TEMP_SUFFIX) for p in root.iterdir())
    assert not torn.exists()
    found = disk.best("fp", "", list(range(1, 1000)), 0)
    assert found is not None
    assert found[1] == 512
    assert disk.read(found[0]) == bytes(64 << 20)
