"""Streams in process, on the tiny model: SSE comments while the model loads, and an
engine crash mid-stream ending each dialect's stream with its own error frame."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from tests.apps import services_of
from tests.test_lifecycle import MakeClient, start

ASK = {"role": "user", "content": "Hello"}


async def test_a_stream_gets_comments_while_the_model_loads(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    client, lc = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    lc.progress_every = 0.01  # the tiny model loads in a few tenths of a second
    body = {"model": "tiny", "messages": [ASK], "max_tokens": 4, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    lines = [line for line in (await resp.text()).splitlines() if line]
    assert lines[0].startswith(": loading the model, ")
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    first = json.loads(data[0][6:])
    assert first["choices"][0]["delta"]["role"] == "assistant"


async def _crash_mid_stream(client: Any, path: str, body: dict[str, Any]) -> str:
    """Start a long stream, kill the engine after its first line, return the rest."""
    resp = await client.post(path, json=body)
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.strip()
    lc = services_of(client.server.app).models.lifecycle
    lease = await lc.acquire("tiny")
    lease.engine.inject_fault(RuntimeError("engine thread killed"))
    await lc.release(lease)
    return str((await asyncio.wait_for(resp.content.read(), 10)).decode())


async def test_an_engine_crash_mid_stream_ends_ollama_ndjson_with_an_error_line(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    client, _ = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    body = {"model": "tiny", "messages": [ASK], "options": {"num_predict": 900}}
    rest = await _crash_mid_stream(client, "/api/chat", body)
    last = json.loads(rest.strip().splitlines()[-1])
    assert set(last) == {"error"}
    assert "crashed" in last["error"]


async def test_an_engine_crash_mid_stream_ends_anthropic_sse_with_an_error_event(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    client, _ = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    body = {"model": "tiny", "messages": [ASK], "max_tokens": 900, "stream": True}
    rest = await _crash_mid_stream(client, "/v1/messages", body)
    events = [line[7:] for line in rest.splitlines() if line.startswith("event: ")]
    assert events[-1] == "error"
    assert "message_stop" not in events
    error = json.loads(rest.split("event: error\ndata: ")[1].splitlines()[0])
    assert error["type"] == "error"
    assert error["error"]["type"] == "overloaded_error"  # 503 -> Anthropic's overloaded
    assert "crashed" in error["error"]["message"]


async def test_an_engine_crash_mid_stream_ends_openai_sse_with_an_error_frame(
    aiohttp_client: MakeClient, tmp_path: Path, tiny_path: Path
) -> None:
    client, _ = await start(aiohttp_client, tmp_path, {"tiny": tiny_path})
    body = {"model": "tiny", "messages": [ASK], "max_tokens": 900, "stream": True}
    rest = await _crash_mid_stream(client, "/v1/chat/completions", body)
    frames = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    error = json.loads(frames[-1])["error"]
    assert error["type"] == "server_error"
    assert "crashed" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "[DONE]" not in rest
