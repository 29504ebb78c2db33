"""An engine crash ends only the requests on that engine, never the process; a dead or
restarting engine is never handed out; token ids from clients are checked first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from barrel.config import decode
from tests.apps import app_for, booted
from tests.hostile.conftest import NORMAL, Hostile, assert_4xx

ROUNDS = 100


def test_out_of_range_token_ids_are_a_400(hostile: Hostile) -> None:
    for path, body in [
        ("/api/generate", {"model": "tiny", "prompt": "Hi", "context": [1, 10**9], "stream": False}),
        ("/v1/completions", {"model": "tiny", "prompt": [5, 2**31 - 1]}),
        ("/v1/completions", {"model": "tiny", "prompt": [5, -4]}),
        ("/detokenize", {"model": "tiny", "tokens": [10**7]}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999999": 5}}),
        ("/v1/embeddings", {"model": "tiny", "input": [[1, 2, 10**8]]}),
    ]:  # fmt: skip
        assert_4xx(hostile.post(path, json=body), 400)
    hostile.still_serving()


@pytest.mark.slow
async def test_crashing_the_engine_mid_stream_while_four_requests_arrive(
    aiohttp_client: Any, tmp_path: Path, tiny_path: Path
) -> None:
    """100 rounds: a stream is running, the engine thread dies, four requests arrive
    within a few milliseconds. Each ends cleanly (answered, or a 503 / an error line),
    the process lives (this test runs in it), and the model serves again."""
    # every round crashes the engine once: more restarts than the default intensity allows
    config = decode(
        f'[models]\ncache_root = "{tmp_path}"\n'
        "[supervision.models]\nintensity = 1000\nperiod_s = 60\n"
    )
    app = app_for(config, local_models={"tiny": str(tiny_path)})
    client = await aiohttp_client(app)
    lifecycle = (await booted(app)).models.lifecycle
    long = {**NORMAL, "stream": True, "options": {"num_predict": 2000, "temperature": 0}}
    outcomes: dict[str, int] = {}
    for _ in range(ROUNDS):
        stream = await client.post("/api/chat", json=long)
        assert stream.status == 200
        assert json.loads(await stream.content.readline())["done"] is False
        lease = await lifecycle.acquire("tiny")
        lease.engine.inject_fault(RuntimeError("engine thread killed"))
        await lifecycle.release(lease)
        arrivals = [asyncio.create_task(client.post("/api/chat", json=NORMAL)) for _ in range(4)]
        last = json.loads((await stream.read()).strip().splitlines()[-1])
        assert last.get("error") or last.get("done") is True, last
        for arrival in arrivals:
            r = await arrival
            body = await r.json()
            if r.status == 200:
                assert body["done"] is True
            else:
                assert r.status == 503, body
                assert body["error"]
            outcomes[str(r.status)] = outcomes.get(str(r.status), 0) + 1
        again = await client.post("/api/chat", json=NORMAL)
        assert again.status == 200, await again.text()
    assert sum(outcomes.values()) == 4 * ROUNDS
