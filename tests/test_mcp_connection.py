"""A tool server's connection (barrel.actors.mcp.Connection) against a real stdio MCP
server (tests/mcp_servers.py), without a model: its concurrency cap, its timeout, a
tool it does not offer, and the restart after the server dies."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from barrel.actors.mcp import Connection
from barrel.config import McpConfig, McpServerConfig
from barrel.pipeline import servertools
from barrel.pipeline.events import CallResult, ServerTool, ToolCallEvent

ROOT = Path(__file__).resolve().parent.parent


def until(check: object, what: str) -> None:
    deadline = time.monotonic() + 60  # a safety net: each of these takes a second or two
    while time.monotonic() < deadline:
        if callable(check) and check():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def connect(tmp_path: Path) -> Iterator[object]:
    opened: list[Connection] = []
    bugs: list[BaseException] = []

    def make(**settings: object) -> Connection:
        argv = [sys.executable, "-m", "tests.mcp_servers", "weather", str(tmp_path)]
        config = McpServerConfig(command=argv, cwd=str(ROOT), **settings)  # type: ignore[arg-type]
        c = Connection("weather", config, McpConfig(max_backoff_s=1.0), bugs.append)
        c.start()
        opened.append(c)
        until(lambda: c.state == "ready", "the server is ready")
        return c

    yield make
    for c in opened:
        c.stop()
    assert not bugs


def logged(folder: Path) -> list[str]:
    log = folder / "calls.log"
    return [json.loads(x)["tool"] for x in log.read_text().splitlines()] if log.exists() else []


def test_the_tools_are_listed_and_a_tool_not_offered_is_refused(connect, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = connect(tools=["get_weather", "hang"])
    assert sorted(c.tools) == ["get_weather", "hang"]
    assert c.tools["get_weather"].parameters["required"] == ["city"]
    outcome = c.call("crash", {}).result(timeout=30)
    assert outcome.kind == "refused"
    assert logged(tmp_path) == []  # never reached the server
    ok = c.call("get_weather", {"city": "Oslo"}).result(timeout=30)
    assert (ok.kind, ok.error) == ("ok", False)
    assert "sunny" in ok.output


@pytest.mark.parametrize("cap", [1, 2])
def test_calls_beyond_the_cap_wait_for_a_slot(connect, tmp_path: Path, cap: int) -> None:  # type: ignore[no-untyped-def]
    c = connect(max_concurrent=cap, timeout_s=60.0)
    held = c.call("hang", {"reason": "release"})
    until(lambda: "hang" in logged(tmp_path), "the held call reached the server")
    weather = c.call("get_weather", {"city": "Oslo"})
    if cap == 1:  # it waits for the only slot: it reaches the server once the first ends
        until(lambda: c.in_flight == 2, "the second call is under way")
        assert logged(tmp_path) == ["hang"]
        (tmp_path / "release").write_text("")
        assert held.result(timeout=30).output == "released"
    else:  # it runs beside the held call
        assert weather.result(timeout=30).kind == "ok"
        assert not held.done()
        (tmp_path / "release").write_text("")
    assert weather.result(timeout=30).kind == "ok"
    assert held.result(timeout=30).kind == "ok"
    assert logged(tmp_path) == ["hang", "get_weather"]


def test_a_call_that_times_out_frees_its_slot(connect, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = connect(max_concurrent=1, timeout_s=2.0)
    hang = c.call("hang", {})
    assert hang.result(timeout=30).kind == "timeout"
    assert c.call("get_weather", {"city": "Oslo"}).result(timeout=30).kind == "ok"
    assert logged(tmp_path) == ["hang", "get_weather"]


def test_a_server_that_dies_is_an_error_result_then_restarted(connect, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = connect(timeout_s=10.0)
    died = c.call("crash", {}).result(timeout=30)
    assert died.error
    assert died.kind in ("failed", "timeout")
    until(lambda: c.restarts >= 1 and c.state == "ready", "the server is up again")
    assert "get_weather" in c.tools
    again = c.call("get_weather", {"city": "Oslo"}).result(timeout=30)
    assert again.kind == "ok"


def test_a_result_past_the_cap_is_cut_with_a_note(connect) -> None:  # type: ignore[no-untyped-def]
    c = connect(max_result_bytes=1000)
    outcome = c.call("flood", {}).result(timeout=30)
    assert outcome.kind == "ok"
    assert outcome.output.startswith("x" * 1000)
    assert outcome.output.endswith("it had 3000000 bytes, 1000 are shown]")


def test_identical_calls_of_one_round_reach_the_server_once(connect, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A round's calls as the turn runs them (barrel.pipeline.servertools) over a real
    connection: three identical calls (same tool and arguments, the JSON spelled
    differently) and one other reach the server twice in all, and each call gets its
    answer. The model's own repeats (seen with Qwen under tool_choice required) cannot
    be had on demand, so the round's calls are given here."""
    c = connect(tools=["get_weather"])

    class Connected:
        tools = (ServerTool("weather", "get_weather", "", {}),)

        async def call(self, tool: ServerTool, arguments: dict[str, object]) -> CallResult:
            return await asyncio.wrap_future(c.call(tool.name, arguments))

    round_calls = [
        ToolCallEvent("a", "get_weather", '{"city": "Oslo"}'),
        ToolCallEvent("b", "get_weather", '{"city":"Oslo"}'),
        ToolCallEvent("c", "get_weather", '{"city": "Rome"}'),
        ToolCallEvent("d", "get_weather", '{ "city" : "Oslo" }'),
    ]
    toolbox = Connected()
    by_name = {t.name: t for t in toolbox.tools}
    results = asyncio.run(servertools.run_once_each(toolbox, by_name, round_calls))
    assert sorted(logged(tmp_path)) == ["get_weather", "get_weather"]
    assert [r.kind for r in results] == ["ok"] * 4
    assert results[0] == results[1] == results[3] != results[2]
    assert "Oslo" in results[0].output
    assert "Rome" in results[2].output
