"""Server-side tools over MCP, through the daemon on Qwen2.5-Coder-0.5B, with real MCP
servers written with the `mcp` SDK (tests/mcp_servers.py): `weather` over stdio, `facts`
over streamable HTTP on 127.0.0.1.

A question that needs both servers' tools gets both calls run at once (each server waits
until the other's call has started, and says so in its answer) and the turn continues
once, on the same sequence; the official SDKs read the call items and blocks. A mixed
batch returns the client's call after running the server's. Hostile servers (a crash
mid-call, a hang, a flood, a line that is not JSON-RPC, a raising tool) become error
results the model reads, and a request naming what it may not use is a 4xx.

The model is small: a two-call turn is asked for with `tool_choice` required and an
earlier exchange in the conversation that shows both calls made together.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from rich.console import Console

from barrel.cli.top import render_status
from tests.daemon import Daemon, free_port, serve_models

ROOT = Path(__file__).resolve().parent.parent
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

# An earlier exchange that shows the model both calls made at once.
SHOWN = [
    {"role": "user", "content": "What is the weather in Rome, and how many people live in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_population", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "The weather in Rome is cloudy, 18 C."},
    {"role": "tool", "tool_call_id": "call_2", "content": "Rome has 2,800,000 inhabitants."},
    {"role": "assistant", "content": "Rome is cloudy at 18 C; 2,800,000 people live there."},
]
ROME = {"city": "Rome"}
# the same exchange as Responses input items
SHOWN_ITEMS = [
    SHOWN[0],
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    },
    {
        "type": "function_call",
        "call_id": "call_2",
        "name": "get_population",
        "arguments": '{"city": "Rome"}',
    },
    {
        "type": "function_call_output",
        "call_id": "call_1",
        "output": "The weather in Rome is cloudy, 18 C.",
    },
    {
        "type": "function_call_output",
        "call_id": "call_2",
        "output": "Rome has 2,800,000 inhabitants.",
    },
    SHOWN[-1],
]
QUESTION = "What is the weather in Paris, and how many people live in Paris?"


def fresh() -> dict[str, str]:
    """A system line no earlier request had: the conversation starts with no cells."""
    return {"role": "system", "content": f"You are a helpful assistant ({uuid.uuid4().hex})."}


def wait_servers(
    daemon: Daemon, names: set[str], restarts: int = 0, key: str = ""
) -> dict[str, Any]:
    """/api/status once every named server is ready (after `restarts` restarts)."""
    deadline = time.monotonic() + 120  # a safety net: servers start in a second or two
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    while time.monotonic() < deadline:
        status = httpx.get(daemon.url + "/api/status", headers=headers, timeout=30).json()
        servers = {s["name"]: s for s in status["tool_servers"]}
        if all(
            servers.get(n, {}).get("state") == "ready" and servers[n]["restarts"] >= restarts
            for n in names
        ):
            return servers
        time.sleep(0.1)
    raise AssertionError(f"tool servers not ready: {status['tool_servers']}")


@pytest.fixture(scope="module")
def calls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp-calls")


@pytest.fixture(scope="module")
def facts_port(calls_dir: Path) -> Iterator[int]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.mcp_servers", "facts", str(calls_dir), "--port", str(port)]
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=quiet, stderr=quiet)
    yield port
    proc.kill()
    proc.wait(timeout=10)


def servers_config(calls_dir: Path, facts_port: int, extra: str = "") -> str:
    argv = json.dumps([sys.executable, "-m", "tests.mcp_servers", "weather", str(calls_dir)])
    return f"""
[models.defaults]
num_seq_max = 4

[mcp]
max_rounds = 2

[mcp.servers.weather]
command = {argv}
cwd = "{ROOT}"
anonymous = true
timeout_s = 4
max_result_bytes = 2048

[mcp.servers.facts]
url = "http://127.0.0.1:{facts_port}/mcp"
anonymous = true
{extra}
"""


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, calls_dir: Path, facts_port: int
) -> Iterator[Daemon]:
    weather = json.dumps([sys.executable, "-m", "tests.mcp_servers", "weather", str(calls_dir)])
    private = f"""
[mcp.servers.private]
command = {weather}
cwd = "{ROOT}"

[mcp.servers.big]
command = {weather}
cwd = "{ROOT}"
anonymous = true
tools = ["flood"]
"""
    config = servers_config(calls_dir, facts_port, private)
    d = serve_models(tmp_path_factory.mktemp("tools"), {"qwen": qwen_path}, config)
    try:
        wait_servers(d, {"weather", "facts", "private", "big"})
        yield d
    finally:
        d.kill()


@pytest.fixture
def calls(calls_dir: Path) -> Iterator[Path]:
    """The calls log, empty; no call waits for another unless a test says so."""
    for f in calls_dir.glob("*"):
        f.unlink()
    yield calls_dir / "calls.log"
    (calls_dir / "expect").unlink(missing_ok=True)


def logged(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def expect_together(calls_dir: Path) -> None:
    (calls_dir / "expect").write_text("get_weather get_population")


# -- two servers, two calls at once, one continuation -------------------------------------


def ask_both(daemon: Daemon, **more: Any) -> list[Any]:
    """The question for both servers through the Responses API, streamed: its events."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    stream = client.responses.create(
        model="qwen",
        input=[fresh(), *SHOWN_ITEMS, {"role": "user", "content": QUESTION}],  # type: ignore[list-item]
        tools=[
            {
                "type": "mcp",
                "server_label": "weather",
                "allowed_tools": ["get_weather"],
                "require_approval": "never",
            },
            {"type": "mcp", "server_label": "facts", "require_approval": "never"},
        ],
        tool_choice="required",
        temperature=0,
        max_output_tokens=120,
        stream=True,
        **more,
    )
    return list(stream)


def test_responses_runs_two_servers_calls_at_once_and_continues_on_the_same_cells(
    daemon: Daemon, calls: Path
) -> None:
    expect_together(calls.parent)
    events = ask_both(daemon)
    kinds = [e.type for e in events]
    assert kinds.count("response.mcp_list_tools.completed") == 2
    assert kinds.count("response.mcp_call.in_progress") == 2
    assert kinds.count("response.mcp_call.completed") == 2
    # both calls started before either finished: they ran together
    first_done = kinds.index("response.mcp_call.completed")
    assert kinds[:first_done].count("response.mcp_call.in_progress") == 2
    response = events[-1].response  # type: ignore[union-attr]
    items = response.output
    mcp_calls = [i for i in items if i.type == "mcp_call"]
    assert sorted(c.name for c in mcp_calls) == ["get_population", "get_weather"]
    assert all("[together]" in (c.output or "") for c in mcp_calls), mcp_calls
    assert {c.server_label for c in mcp_calls} == {"weather", "facts"}
    listed = {
        i.server_label: [t.name for t in i.tools] for i in items if i.type == "mcp_list_tools"
    }
    assert listed == {"weather": ["get_weather"], "facts": ["get_population"]}
    # one continuation: the two calls, then the answer, and no other call
    assert [i.type for i in items][-1] == "message"
    assert len(logged(calls)) == 2
    answer = response.output_text
    assert "23" in answer or "sunny" in answer.lower() or "2,100,000" in answer, answer
    # The usage counts both rounds' prompts. The first is new (its own system line); had
    # the continuation prefilled the conversation again, nearly all of both would be
    # computed, where it computes only the calls and their results.
    usage = response.usage
    assert usage is not None
    computed = usage.input_tokens - usage.input_tokens_details.cached_tokens
    assert computed < 0.7 * usage.input_tokens, usage


def test_parallel_tool_calls_false_runs_one_call_a_round(daemon: Daemon, calls: Path) -> None:
    events = ask_both(daemon, parallel_tool_calls=False)
    running = 0
    for event in events:  # never two calls in flight
        running += event.type == "response.mcp_call.in_progress"
        running -= event.type in ("response.mcp_call.completed", "response.mcp_call.failed")
        assert running <= 1
    assert 1 <= len(logged(calls)) <= 2  # a call a round, max_rounds 2


def test_anthropic_mcp_connector_streams_tool_use_and_result_blocks(
    daemon: Daemon, calls: Path, facts_port: int
) -> None:
    expect_together(calls.parent)
    client = anthropic.Anthropic(base_url=daemon.url, api_key="none")
    shown: list[Any] = [
        SHOWN[0],
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Rome"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "get_population",
                    "input": {"city": "Rome"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Cloudy, 18 C."},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "2,800,000 people."},
            ],
        },
        {"role": "assistant", "content": SHOWN[-1]["content"]},
        {"role": "user", "content": QUESTION},
    ]
    with client.beta.messages.stream(
        model="qwen",
        max_tokens=120,
        system=fresh()["content"],
        messages=shown,
        mcp_servers=[
            {
                "type": "url",
                "name": "weather",
                "url": "",  # a stdio server: no URL to give
                "tool_configuration": {"allowed_tools": ["get_weather"]},
            },
            {"type": "url", "name": "facts", "url": f"http://127.0.0.1:{facts_port}/mcp"},
        ],
        tool_choice={"type": "any"},
        betas=["mcp-client-2025-04-04"],
        extra_body={"temperature": 0},
    ) as stream:
        starts = [e.content_block.type for e in stream if e.type == "content_block_start"]
        message = stream.get_final_message()
    assert starts.count("mcp_tool_use") == 2
    assert starts.count("mcp_tool_result") == 2
    uses = [b for b in message.content if b.type == "mcp_tool_use"]
    results = [b for b in message.content if b.type == "mcp_tool_result"]
    assert {u.server_name for u in uses} == {"weather", "facts"}
    assert {r.tool_use_id for r in results} == {u.id for u in uses}
    assert all(not r.is_error for r in results)
    texts = [c.text for r in results for c in r.content if not isinstance(r.content, str)]  # type: ignore[union-attr]
    assert all("[together]" in t for t in texts), texts
    final = message.content[-1]
    assert final.type == "text"
    assert "23" in final.text or "sunny" in final.text.lower() or "2,100,000" in final.text
    assert len(logged(calls)) == 2
    usage = message.usage  # Anthropic's input_tokens are those not read from the cache
    assert usage.cache_read_input_tokens is not None
    total = usage.input_tokens + usage.cache_read_input_tokens
    assert usage.input_tokens < 0.7 * total, usage


# -- a mixed batch ------------------------------------------------------------------------


def test_mixed_batch_runs_the_server_call_and_returns_the_clients(
    daemon: Daemon, calls: Path
) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    population = {
        "type": "function",
        "function": {
            "name": "get_population",
            "description": "Get the number of people living in a city.",
            "parameters": WEATHER,
        },
    }
    messages: list[Any] = [*SHOWN, {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model="qwen",
        messages=messages,
        tools=[population],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        extra_body={"mcp_servers": [{"name": "weather", "allowed_tools": ["get_weather"]}]},
    )
    choice = first.choices[0]
    assert [e["tool"] for e in logged(calls)] == ["get_weather"]  # the server's call ran
    ran = (choice.message.model_extra or {})["server_tool_calls"]
    assert [(r["server"], r["name"], r["is_error"]) for r in ran] == [
        ("weather", "get_weather", False)
    ]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_population"]
    call = (choice.message.tool_calls or [])[0]
    # the client runs its tool and the conversation goes on
    follow = client.chat.completions.create(
        model="qwen",
        messages=[
            *messages,
            choice.message.model_dump(exclude_none=True, exclude={"server_tool_calls"}),
            {"role": "tool", "tool_call_id": call.id, "content": "Paris has 2,100,000 people."},
        ],
        tools=[population],  # type: ignore[list-item]
        temperature=0,
        max_tokens=60,
        extra_body={"mcp_servers": [{"name": "weather", "allowed_tools": ["get_weather"]}]},
    )
    assert follow.choices[0].message.content
    usage = follow.usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    # The conversation's cells were kept: only the turn's call and its result are
    # computed (the pinned tools head alone would leave more than half of it to compute).
    computed = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    assert computed < 0.25 * usage.prompt_tokens, usage


# -- hostile servers ----------------------------------------------------------------------


def call_tool(daemon: Daemon, tool: str, server: str = "weather") -> dict[str, Any]:
    """Force one call of `tool`; the server call's record (Barrel's field)."""
    r = httpx.post(
        daemon.url + "/v1/chat/completions",
        json={
            "model": "qwen",
            "messages": [{"role": "user", "content": f"Use the {tool} tool."}],
            "tool_choice": {"type": "function", "function": {"name": tool}},
            "mcp_servers": [{"name": server, "allowed_tools": [tool]}],
            "temperature": 0,
            "max_tokens": 40,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    records = r.json()["choices"][0]["message"]["server_tool_calls"]
    assert [x["name"] for x in records][:1] == [tool]
    return dict(records[0])


def test_a_server_that_crashes_mid_call_is_an_error_result_and_is_restarted(
    daemon: Daemon, calls: Path
) -> None:
    before = wait_servers(daemon, {"weather"})["weather"]["restarts"]
    record = call_tool(daemon, "crash")
    assert record["is_error"] is True
    assert "weather" in record["output"]
    servers = wait_servers(daemon, {"weather"}, restarts=before + 1)
    assert "get_weather" in servers["weather"]["tools"]  # listed again after the restart
    status = httpx.get(daemon.url + "/api/status", timeout=30).json()
    restarts = {s["name"]: s["restarts"] for s in status["tool_servers"]}["weather"]
    assert restarts > before
    console = Console(width=200, record=True)
    console.print(render_status(status))
    line = next(x for x in console.export_text().splitlines() if x.startswith("Tool servers:"))
    assert f"weather ready (6 tools, {restarts} restarts)" in line, line
    again = call_tool(daemon, "get_weather")
    assert again["is_error"] is False
    assert "sunny" in again["output"]


def test_a_hanging_tool_times_out_and_others_are_served(daemon: Daemon, calls: Path) -> None:
    record = call_tool(daemon, "hang")
    assert record["is_error"] is True
    assert "timed out" in record["output"]
    assert call_tool(daemon, "get_population", "facts")["is_error"] is False


def test_a_flood_is_cut_with_a_note(daemon: Daemon, calls: Path) -> None:
    record = call_tool(daemon, "flood")
    assert record["is_error"] is False
    assert record["output"].startswith("x" * 2048)
    assert len(record["output"]) < 2200
    assert "was cut here: it had 3000000 bytes, 2048 are shown" in record["output"]


def test_results_too_long_for_the_context_end_the_turn_as_it_stands(
    daemon: Daemon, calls: Path
) -> None:
    r = httpx.post(
        daemon.url + "/v1/chat/completions",
        json={
            "model": "qwen",
            "messages": [{"role": "user", "content": "Use the flood tool."}],
            "tool_choice": "required",
            "mcp_servers": ["big"],
            "temperature": 0,  # sampled, a long `reason` could spend max_tokens before the call
            "max_tokens": 100,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    (record,) = choice["message"]["server_tool_calls"]  # 64 KiB: past the 2,048-token context
    assert record["is_error"] is False
    assert len(record["output"]) > 65536
    status = httpx.get(daemon.url + "/api/status", timeout=30).json()
    assert {s["name"]: s["state"] for s in status["tool_servers"]}["big"] == "ready"


def test_a_line_that_is_not_json_rpc_and_a_raising_tool_are_error_results(
    daemon: Daemon, calls: Path
) -> None:
    garbled = call_tool(daemon, "garble")
    assert garbled["is_error"] is True
    failed = call_tool(daemon, "fail")
    assert failed["is_error"] is True
    assert "Error executing tool fail" in failed["output"]  # the server's words, as they are
    wait_servers(daemon, {"weather"})
    assert call_tool(daemon, "get_weather")["is_error"] is False


def test_metrics_count_the_calls_by_outcome(daemon: Daemon, calls: Path) -> None:
    call_tool(daemon, "get_weather")
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    assert 'barrel_tool_calls_total{outcome="ok",server="weather",tool="get_weather"}' in text
    assert "barrel_tool_call_duration_seconds_bucket" in text


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"mcp_servers": ["nowhere"]}, 400, "no tool server 'nowhere' is configured"),
        ({"mcp_servers": ["private"]}, 403, "not open to callers without a key"),
        ({"mcp_servers": [{"name": "weather", "allowed_tools": ["rm"]}]}, 400, "no tool 'rm'"),
        ({"mcp_servers": "weather"}, 400, "mcp_servers"),
        ({"mcp_servers": ["weather"], "n": 2}, 400, "n must be 1"),
    ],
)
def test_what_a_request_may_not_use_is_a_4xx(
    daemon: Daemon, body: dict[str, Any], status: int, words: str
) -> None:
    payload = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(daemon.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_a_url_the_configuration_does_not_give_is_refused(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match=r"not at 'http://evil\.example/mcp'"):
        client.responses.create(
            model="qwen",
            input="hi",
            tools=[
                {
                    "type": "mcp",
                    "server_label": "facts",
                    "server_url": "http://evil.example/mcp",
                    "require_approval": "never",
                }
            ],
        )
    with pytest.raises(openai.BadRequestError, match="require_approval"):
        client.responses.create(
            model="qwen",
            input="hi",
            tools=[{"type": "mcp", "server_label": "facts", "require_approval": "always"}],
        )


# -- API keys -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, calls_dir: Path, facts_port: int
) -> Iterator[Daemon]:
    extra = (
        '[mcp.servers.weather.keys]\n"key-a" = ["get_weather"]\n'
        '[auth]\napi_keys = ["key-a", "key-b"]\n'
    )
    config = servers_config(calls_dir, facts_port)
    config = config.replace("anonymous = true\ntimeout_s = 4", "timeout_s = 4")
    d = serve_models(tmp_path_factory.mktemp("keyed"), {"qwen": qwen_path}, config + extra)
    try:
        wait_servers(d, {"weather", "facts"}, key="key-a")
        yield d
    finally:
        d.kill()


def test_each_key_uses_only_its_allow_list(keyed: Daemon, calls: Path) -> None:
    def ask(key: str, servers: list[Any]) -> httpx.Response:
        return httpx.post(
            keyed.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "qwen",
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "mcp_servers": servers,
                "temperature": 0,
                "max_tokens": 40,
            },
            timeout=300,
        )

    refused = ask("key-b", ["weather"])
    assert refused.status_code == 403
    assert "may not use the tool server 'weather'" in refused.json()["error"]["message"]
    narrowed = ask("key-a", [{"name": "weather", "allowed_tools": ["crash"]}])
    assert narrowed.status_code == 400
    served = ask("key-a", ["weather"])
    assert served.status_code == 200, served.text
    records = served.json()["choices"][0]["message"]["server_tool_calls"]
    assert [r["name"] for r in records] == ["get_weather"]  # its only tool
    assert ask("key-b", ["facts"]).status_code == 200  # facts lists no keys: every key
    assert [e["tool"] for e in logged(calls)] == ["get_weather", "get_population"]


# -- the turn's budget, its endings, the MCP tool choice, identical calls -----------------

POEM = "Look up the weather in Paris with the tool, then write a long poem about it."
# the weather server's other tools take a free-text reason the model may spend the
# budget on before the call is made
WEATHER_ONLY: Any = {
    "type": "mcp",
    "server_label": "weather",
    "require_approval": "never",
    "allowed_tools": ["get_weather"],
}


def test_max_output_tokens_bounds_the_whole_turn_through_the_sdks(
    daemon: Daemon, calls: Path
) -> None:
    """Round 1 makes the forced call (~20 tokens); round 2's poem would take all 60 again
    if each round had the client's budget: the turn stops at 60 in all, cut as the
    dialect cuts an answer, the call made."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    r = client.responses.create(
        model="qwen",
        input=[fresh(), {"role": "user", "content": POEM}],
        tools=[WEATHER_ONLY],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    assert next((i.type for i in r.output if i.type != "mcp_list_tools"), "") == "mcp_call", r
    assert r.usage is not None
    assert r.usage.output_tokens <= 60, r.usage
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    message = anthropic.Anthropic(base_url=daemon.url, api_key="none").beta.messages.create(
        model="qwen",
        max_tokens=60,
        system=fresh()["content"],
        messages=[{"role": "user", "content": POEM}],
        mcp_servers=[
            {
                "type": "url",
                "name": "weather",
                "url": "",
                "tool_configuration": {"allowed_tools": ["get_weather"]},
            }
        ],
        tool_choice={"type": "any"},
        betas=["mcp-client-2025-04-04"],
        extra_body={"temperature": 0},
    )
    assert message.content[0].type == "mcp_tool_use", message.content
    assert message.usage.output_tokens <= 60, message.usage
    assert message.stop_reason == "max_tokens"
    assert len(logged(calls)) == 2  # one call a turn


def test_a_turn_whose_results_outgrow_the_context_says_so_in_each_dialect(
    daemon: Daemon, calls: Path
) -> None:
    """The flood's 64 KiB result cannot follow the first round: the turn ends with the
    word each dialect has for a full context window, its usage that of the round that
    ran (the refused round computed nothing)."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    r = client.responses.create(
        model="qwen",
        input=[fresh(), {"role": "user", "content": "Use the flood tool."}],
        tools=[{"type": "mcp", "server_label": "big", "require_approval": "never"}],
        tool_choice="required",
        temperature=0,
        max_output_tokens=100,
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "context_length_exceeded"
    (call,) = [i for i in r.output if i.type == "mcp_call"]
    assert call.name == "flood"
    assert r.usage is not None
    assert 0 < r.usage.output_tokens < 100  # the call's tokens: the budget was not spent
    assert r.usage.input_tokens > 0
    message = anthropic.Anthropic(base_url=daemon.url, api_key="none").beta.messages.create(
        model="qwen",
        max_tokens=100,
        messages=[{"role": "user", "content": "Use the flood tool."}],
        mcp_servers=[{"type": "url", "name": "big", "url": ""}],
        tool_choice={"type": "any"},
        betas=["mcp-client-2025-04-04"],
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "model_context_window_exceeded"
    assert 0 < message.usage.output_tokens < 100


def test_openai_s_mcp_tool_choice_forces_that_server_s_tool(daemon: Daemon, calls: Path) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none")
    tools: Any = [
        {"type": "mcp", "server_label": "weather", "require_approval": "never",
         "allowed_tools": ["get_weather"]},
        {"type": "mcp", "server_label": "facts", "require_approval": "never"},
    ]  # fmt: skip
    r = client.responses.create(
        model="qwen",
        input=[fresh(), {"role": "user", "content": "How many people live in Oslo?"}],
        tools=tools,
        tool_choice={"type": "mcp", "server_label": "weather", "name": "get_weather"},
        temperature=0,
        max_output_tokens=80,
    )
    forced = next(i for i in r.output if i.type == "mcp_call")
    assert (forced.server_label, forced.name) == ("weather", "get_weather")
    assert logged(calls)[0]["tool"] == "get_weather"
    with pytest.raises(openai.BadRequestError, match=r"not among the tools|may not use"):
        client.responses.create(
            model="qwen",
            input="Hi",
            tools=tools,
            tool_choice={"type": "mcp", "server_label": "weather", "name": "crash"},
        )
