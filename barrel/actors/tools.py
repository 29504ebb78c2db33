"""The facade's side of tool servers: which configured servers and tools a request may
use, and the calls themselves (run by the servers' connections, barrel.actors.mcp).

    toolbox = models.tools.grant(req.servers, scope)     # 4xx/503, before any lease
    gen = await generation.start(session, req, limits, toolbox)

Who may use what: a daemon without API keys offers a server only where its
configuration says `anonymous = true`; with keys, a server's `keys` table lists the keys
that may use it and their tools ("*": all), and an empty table lets every key use all
of them. A request names servers by their configured name; a URL it sends must be the
configured one. Nothing a request says starts a process or reaches a URL of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from barrel.actors.mcp import ServerState, ToolDirectory, timed_out
from barrel.config import Config, McpServerConfig
from barrel.errors import Forbidden, InvalidRequest, Unavailable
from barrel.metrics import Metrics
from barrel.pipeline.events import CallResult, ServerTool
from barrel.pipeline.request import ServerUse

# Past the server's own timeout, the facade's wait for a connection that does not answer.
GRACE_S = 5.0


def key_scope(key: bytes) -> str:
    """An API key as requests carry it in their scope (never the key itself)."""
    return hashlib.sha256(key).hexdigest()[:16]


class ToolServers:
    def __init__(self, config: Config, directory: ToolDirectory, metrics: Metrics | None) -> None:
        self.config = config.mcp
        self.directory = directory
        self.metrics = metrics
        self._keys_on = bool(config.auth.api_keys)
        self._grants = {
            name: {key_scope(k.encode()): tuple(tools) for k, tools in server.keys.items()}
            for name, server in self.config.servers.items()
        }

    @property
    def max_rounds(self) -> int:
        return self.config.max_rounds

    def states(self) -> list[ServerState]:
        return sorted(self.directory.states(), key=lambda s: s.name)

    def grant(self, uses: tuple[ServerUse, ...], scope: str) -> GrantedTools | None:
        """The tools `uses` may call for the caller of `scope`, or a 4xx/503 saying why
        not. None when the request names no server."""
        if not uses:
            return None
        tools: list[ServerTool] = []
        for use in uses:
            server = self._configured(use)
            allowed = self._allowed(use.name, server, scope)
            connection = self.directory.get(use.name)
            if connection is None or connection.state != "ready":
                state = connection.snapshot() if connection is not None else None
                why = f" ({state.state}: {state.error})" if state and state.error else ""
                raise Unavailable(f"the tool server {use.name!r} is not ready{why}")
            offered = connection.tools
            for name in use.tools or ():
                if name not in offered or (allowed is not None and name not in allowed):
                    raise InvalidRequest(
                        f"the tool server {use.name!r} offers no tool {name!r} to this caller",
                        param="tools",
                    )
            for tool in offered.values():
                if allowed is not None and tool.name not in allowed:
                    continue
                if use.tools is not None and tool.name not in use.tools:
                    continue
                tools.append(tool)
        return GrantedTools(tuple(tools), self)

    def _configured(self, use: ServerUse) -> McpServerConfig:
        server = self.config.servers.get(use.name)
        if server is None:
            raise InvalidRequest(
                f"no tool server {use.name!r} is configured; a request may use only the "
                "servers in the daemon's [mcp.servers]",
                param="tools",
            )
        if use.url and use.url.rstrip("/") != server.url.rstrip("/"):
            raise InvalidRequest(
                f"the tool server {use.name!r} is not at {use.url!r}; a request may not "
                "name a URL the configuration does not give",
                param="tools",
            )
        return server

    def _allowed(self, name: str, server: McpServerConfig, scope: str) -> frozenset[str] | None:
        """The tools this caller may use (None: all), or Forbidden."""
        if not self._keys_on or not scope:
            if not server.anonymous:
                raise Forbidden(f"the tool server {name!r} is not open to callers without a key")
            return None
        grants = self._grants[name]
        if not grants:
            return None
        tools = grants.get(scope)
        if tools is None:
            raise Forbidden(f"this API key may not use the tool server {name!r}")
        return None if "*" in tools else frozenset(tools)

    async def call(self, tool: ServerTool, arguments: dict[str, Any]) -> CallResult:
        connection = self.directory.get(tool.server)
        server = self.config.servers[tool.server]
        if connection is None:
            result = CallResult(f"the tool server {tool.server} is not running", "failed")
        else:
            future = asyncio.wrap_future(connection.call(tool.name, arguments))
            try:
                result = await asyncio.wait_for(future, server.timeout_s + GRACE_S)
            except TimeoutError:
                result = timed_out(tool.name, server.timeout_s)
        if self.metrics is not None:
            self.metrics.tool_call(tool.server, tool.name, result.kind, result.seconds)
        return result


@dataclass(frozen=True)
class GrantedTools:
    """One request's server tools (barrel.pipeline.servertools.Toolbox)."""

    tools: tuple[ServerTool, ...]
    servers: ToolServers

    async def call(self, tool: ServerTool, arguments: dict[str, Any]) -> CallResult:
        return await self.servers.call(tool, arguments)
