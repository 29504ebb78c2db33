"""Real MCP tool servers for the tests, written with the `mcp` SDK.

    python -m tests.mcp_servers weather DIR             (stdio)
    python -m tests.mcp_servers facts DIR --port PORT   (streamable HTTP on 127.0.0.1)

`weather` (stdio) offers `get_weather`; `facts` (HTTP) offers `get_population`. Each
call writes `DIR/<tool>.started`, then waits (at most WAIT_S) until every other tool
named in `DIR/expect` has started too, and says in its answer whether it saw them
("together") or gave up ("alone"): the test learns whether Barrel ran the calls at once
without a clock. Every call appends its tool and arguments to `DIR/calls.log`.

Hostile tools on `weather`: `crash` (the process exits mid-call), `hang` (never
answers), `flood` (a 3 MB answer), `garble` (writes a line that is not JSON-RPC, then
never answers) and `fail` (the tool raises).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

WAIT_S = 20.0


def _record(folder: Path, tool: str, arguments: dict[str, object]) -> None:
    with (folder / "calls.log").open("a") as log:
        log.write(json.dumps({"tool": tool, "arguments": arguments, "pid": os.getpid()}) + "\n")


async def _meet(folder: Path, tool: str) -> str:
    """Say this call started; wait for the others `expect` names."""
    (folder / f"{tool}.started").write_text("")
    expect_file = folder / "expect"
    expected = expect_file.read_text().split() if expect_file.exists() else []
    others = [t for t in expected if t != tool]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while loop.time() < deadline:
        if all((folder / f"{t}.started").exists() for t in others):
            return "together"
        await asyncio.sleep(0.05)
    return "alone"


def weather_server(folder: Path) -> MCPServer:
    app = MCPServer("weather")

    @app.tool()
    async def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        _record(folder, "get_weather", {"city": city})
        seen = await _meet(folder, "get_weather")
        return f"The weather in {city} is sunny, 23 degrees Celsius. [{seen}]"

    @app.tool()
    async def crash(reason: str = "") -> str:
        """Crash the server."""
        _record(folder, "crash", {"reason": reason})
        os._exit(3)

    @app.tool()
    async def hang(reason: str = "") -> str:
        """Never answer (with reason "release": until the folder holds a file `release`)."""
        _record(folder, "hang", {"reason": reason})
        for _ in range(72_000 if reason == "release" else 0):  # an hour, polled
            if (folder / "release").exists():
                return "released"
            await asyncio.sleep(0.05)
        await asyncio.sleep(3600)
        return "late"

    @app.tool()
    async def flood(reason: str = "") -> str:
        """Answer with far too much text."""
        _record(folder, "flood", {"reason": reason})
        return "x" * 3_000_000

    @app.tool()
    async def garble(reason: str = "") -> str:
        """Write something that is not JSON-RPC, then never answer."""
        _record(folder, "garble", {"reason": reason})
        os.write(sys.stdout.fileno(), b'{"jsonrpc": "2.0", "id": 99, "result": \n')
        await asyncio.sleep(3600)
        return "late"

    @app.tool()
    async def fail(reason: str = "") -> str:
        """Raise an error."""
        _record(folder, "fail", {"reason": reason})
        raise RuntimeError("the disk is on fire")

    return app


def facts_server(folder: Path) -> MCPServer:
    app = MCPServer("facts")

    @app.tool()
    async def get_population(city: str) -> str:
        """Get the number of people living in a city."""
        _record(folder, "get_population", {"city": city})
        seen = await _meet(folder, "get_population")
        return f"{city} has 2,100,000 inhabitants. [{seen}]"

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server", choices=["weather", "facts"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.server == "weather":
        weather_server(args.folder).run("stdio")
    else:
        facts_server(args.folder).run(
            "streamable-http", host="127.0.0.1", port=args.port, stateless_http=False
        )


if __name__ == "__main__":
    main()
