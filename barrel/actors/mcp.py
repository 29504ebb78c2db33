"""Tool servers: one supervised child per MCP server the configuration lists.

    mcp_sup (one_for_one)
    └── mcp:<name>   McpServer, permanent: owns the server's connection

The MCP SDK is asynchronous and a tool server may be slow, hang or die: none of that may
reach the daemon's event loop. So each `McpServer` actor owns a `Connection`, a thread
running an asyncio loop of its own. On it one task keeps the server up: start it (stdio:
its process; HTTP: a session), initialize, list its tools, then ping it every few
seconds; when the connection ends (the process exited, a ping failed, a call found it
closed) it connects again after a backoff that doubles up to `mcp.max_backoff_s`, and
lists the tools anew. Calls come from any thread (`Connection.call`), run on that loop
under the server's concurrency cap and timeout, and always answer a `CallResult`: a
failure, a timeout, a server that died mid-call or a result too large become an error
result or a cut one, never an exception for the caller.

The actor is a Child like any other: a bug in the connection's own code crashes it
(`_Bug`), and its supervisor starts a fresh one. While it runs, its `Connection` is in
the `ToolDirectory` the facade reads (barrel.actors.tools).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pykka

from barrel.actors.child import Child, Exit, Link
from barrel.config import McpConfig, McpServerConfig
from barrel.pipeline.events import CallResult, ServerTool

logger = logging.getLogger(__name__)

PING_EVERY_S = 5.0
PING_TIMEOUT_S = 10.0
# A server that stayed up this long starts its backoff from the beginning again.
STABLE_S = 60.0
STOP_TIMEOUT_S = 10.0
CUT_NOTE = "\n[the tool's result was cut here: it had {size} bytes, {limit} are shown]"


def timed_out(tool: str, timeout_s: float) -> CallResult:
    """A call that did not answer within its server's `timeout_s` (waiting for the
    server included)."""
    return CallResult(f"the tool {tool} timed out after {timeout_s:g}s", "timeout", timeout_s)


@dataclass(frozen=True)
class ServerState:
    name: str
    transport: str  # stdio | http
    state: str  # connecting | ready | restarting | stopped
    tools: tuple[str, ...]
    restarts: int
    error: str
    in_flight: int


class Connection:
    """One configured server's connection, on an event loop in a thread of its own."""

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        limits: McpConfig,
        on_bug: Callable[[BaseException], None],
    ) -> None:
        self.name = name
        self.config = config
        self.limits = limits
        self._on_bug = on_bug
        self.state = "connecting"
        self.error = ""
        self.restarts = 0
        self.in_flight = 0
        self.tools: dict[str, ServerTool] = {}
        self._session: Any = None
        # bound to the connection's loop at their first use (on its thread)
        self._broken = asyncio.Event()
        self._ready = asyncio.Event()
        self._gate = asyncio.Semaphore(config.max_concurrent)
        self._main: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"mcp-{name}", daemon=True)

    @property
    def transport(self) -> str:
        return "http" if self.config.url else "stdio"

    def snapshot(self) -> ServerState:
        return ServerState(
            self.name,
            self.transport,
            self.state,
            tuple(sorted(self.tools)),
            self.restarts,
            self.error,
            self.in_flight,
        )

    # -- the thread ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the connection (the server process with it) and the thread; bounded."""
        if not self._thread.is_alive():
            return

        def cancel() -> None:
            if self._main is not None:
                self._main.cancel()

        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(cancel)
        self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("mcp %s: the connection did not end in %ss", self.name, STOP_TIMEOUT_S)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._main = self._loop.create_task(self._keep_up())
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            logger.exception("mcp %s: the connection failed", self.name)
            self._on_bug(exc)
        finally:
            self.state = "stopped"
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        with contextlib.suppress(BaseException):
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    # -- keeping the server up ----------------------------------------------------

    async def _keep_up(self) -> None:
        backoff = 1.0
        while True:
            began = time.monotonic()
            try:
                await self._serve()
                self.error = "the server closed the connection"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever ends a connection
                self.error = _reason(exc)
            self._session = None
            self._ready.clear()
            self.state = "restarting"
            self.restarts += 1
            if time.monotonic() - began > STABLE_S:
                backoff = 1.0
            logger.warning("mcp %s: %s; connecting again in %.0fs", self.name, self.error, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.limits.max_backoff_s)

    async def _serve(self) -> None:
        from mcp import ClientSession  # the SDK loads only where servers are configured

        async with self._streams() as (read, write), ClientSession(read, write) as session:
            await asyncio.wait_for(self._handshake(session), self.limits.connect_timeout_s)
            self._session = session
            self._broken.clear()
            self.state, self.error = "ready", ""
            self._ready.set()
            logger.info("mcp %s: ready with %d tools", self.name, len(self.tools))
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._broken.wait(), PING_EVERY_S)
                if self._broken.is_set():
                    raise ConnectionError("the server stopped answering")
                await asyncio.wait_for(session.send_ping(), PING_TIMEOUT_S)

    async def _handshake(self, session: Any) -> None:
        await session.initialize()
        listed: dict[str, ServerTool] = {}
        cursor = None
        while True:
            from mcp.types import PaginatedRequestParams

            params = PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            for tool in page.tools:
                offered = not self.config.tools or tool.name in self.config.tools
                if offered:
                    schema = tool.input_schema if isinstance(tool.input_schema, dict) else {}
                    listed[tool.name] = ServerTool(
                        self.name, tool.name, tool.description or "", schema
                    )
            cursor = page.next_cursor
            if not cursor or len(listed) > 1024:
                break
        self.tools = listed

    @contextlib.asynccontextmanager
    async def _streams(self) -> AsyncIterator[tuple[Any, Any]]:
        if self.config.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            headers = dict(self.config.headers)
            for header, var in self.config.headers_env.items():
                if os.environ.get(var):
                    headers[header] = os.environ[var]
            timeout = httpx2.Timeout(self.config.timeout_s, read=None)
            async with (
                httpx2.AsyncClient(headers=headers, timeout=timeout) as http,
                streamable_http_client(self.config.url, http_client=http) as streams,
            ):
                yield streams[0], streams[1]
            return
        from mcp import StdioServerParameters, stdio_client

        argv = self.config.command
        params = StdioServerParameters(
            command=argv[0],
            args=list(argv[1:]),
            env={**os.environ, **self.config.env},
            cwd=self.config.cwd or None,
        )
        async with stdio_client(params) as streams:
            yield streams[0], streams[1]

    # -- calls ---------------------------------------------------------------------

    def call(self, tool: str, arguments: dict[str, Any]) -> concurrent.futures.Future[CallResult]:
        """Run `tool` on the server from any thread; the future always gets an CallResult."""
        try:
            return asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self._loop)
        except RuntimeError:  # the loop is closed: the actor is ending
            done: concurrent.futures.Future[CallResult] = concurrent.futures.Future()
            done.set_result(CallResult(f"the tool server {self.name} is stopped", "failed", 0.0))
            return done

    async def _call(self, tool: str, arguments: dict[str, Any]) -> CallResult:
        began = time.monotonic()
        self.in_flight += 1
        try:
            text, kind = await asyncio.wait_for(
                self._call_when_ready(tool, arguments), self.config.timeout_s
            )
        except TimeoutError:
            return timed_out(tool, self.config.timeout_s)
        finally:
            self.in_flight -= 1
        return CallResult(text, kind, time.monotonic() - began)

    async def _call_when_ready(self, tool: str, arguments: dict[str, Any]) -> tuple[str, str]:
        if tool not in self.tools:
            return f"the tool server {self.name} offers no tool {tool}", "refused"
        async with self._gate:
            await self._ready.wait()
            session = self._session
            try:
                result = await session.call_tool(tool, arguments)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the server's fault, told to the model
                if self._session is session:
                    self._broken.set()  # check the connection now, not at the next ping
                return f"the tool server {self.name} failed: {_reason(exc)}", "failed"
        text = _text_of(result)
        limit = self.config.max_result_bytes
        data = text.encode()
        if len(data) > limit:
            cut = data[:limit].decode(errors="ignore")
            text = cut + CUT_NOTE.format(size=len(data), limit=limit)
        return text, "error" if getattr(result, "is_error", False) else "ok"


def _text_of(result: Any) -> str:
    """A CallToolResult's content as text: text parts as they are, structured content
    as JSON when there is no text, other parts named."""
    parts: list[str] = []
    for item in getattr(result, "content", None) or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(str(getattr(item, "text", "")))
        else:
            parts.append(f"[{kind or 'unknown'} content]")
    if not parts and getattr(result, "structured_content", None) is not None:
        import json

        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _reason(exc: BaseException) -> str:
    """An exception as one short line (the SDK nests them in exception groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:300]


class _Bug:
    """The connection's thread failed: crash the actor so its supervisor restarts it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ToolDirectory:
    """The running connections by server name: written by the McpServer actors, read by
    the facade (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: dict[str, Connection] = {}

    def put(self, connection: Connection) -> None:
        with self._lock:
            self._connections[connection.name] = connection

    def drop(self, connection: Connection) -> None:
        with self._lock:
            if self._connections.get(connection.name) is connection:
                del self._connections[connection.name]

    def get(self, name: str) -> Connection | None:
        with self._lock:
            return self._connections.get(name)

    def states(self) -> list[ServerState]:
        with self._lock:
            connections = list(self._connections.values())
        return [c.snapshot() for c in connections]


class McpServer(Child):
    """The supervised owner of one server's `Connection`."""

    def __init__(
        self,
        link: Link,
        name: str,
        config: McpServerConfig,
        limits: McpConfig,
        directory: ToolDirectory,
    ) -> None:
        super().__init__(link)
        self.name = name
        self.directory = directory
        self.connection = Connection(name, config, limits, self._bug)

    @classmethod
    def start_child(
        cls,
        link: Link,
        *,
        name: str,
        config: McpServerConfig,
        limits: McpConfig,
        directory: ToolDirectory,
    ) -> pykka.ActorRef[Any]:
        return cls.start(link, name, config, limits, directory)

    def init(self) -> None:
        self.connection.start()
        self.directory.put(self.connection)

    def terminate(self, reason: Exit) -> None:
        self.directory.drop(self.connection)
        self.connection.stop()

    def _bug(self, error: BaseException) -> None:
        with contextlib.suppress(pykka.ActorDeadError):
            self.actor_ref.tell(_Bug(error))

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Bug):
            raise RuntimeError(f"mcp {self.name}: the connection failed") from message.error
        return super().on_receive(message)
