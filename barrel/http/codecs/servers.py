"""The tool servers a request lets the model use, as each dialect names them: pure
readers into `ServerUse` (the names are checked against the configuration later, in
barrel.actors.tools) and the one JSON shape Barrel's own field returns them in.

- OpenAI Chat Completions and Ollama `/api/chat`: Barrel's field `mcp_servers`, a list
  of configured server names or `{"name": ..., "allowed_tools": [...]}` objects.
- OpenAI Responses: `tools` entries `{"type": "mcp", "server_label": ..., "server_url"?,
  "allowed_tools"?, "require_approval": "never"}`.
- Anthropic Messages: `mcp_servers` entries `{"type": "url", "name": ..., "url": ...,
  "tool_configuration"?: {"enabled", "allowed_tools"}}`.
"""

from __future__ import annotations

from typing import Any

from barrel.errors import InvalidRequest
from barrel.pipeline.events import ServerCall, ServerResult
from barrel.pipeline.request import Message, ServerUse, TextPart, ToolCall

MAX_NAME = 64
MAX_ALLOWED = 256


def _names(value: Any, param: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, dict) and "tool_names" in value:  # Responses' filter object
        value = value["tool_names"]
    if not isinstance(value, list) or len(value) > MAX_ALLOWED:
        raise InvalidRequest(f"{param}: a list of at most {MAX_ALLOWED} tool names", param=param)
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_NAME for v in value):
        raise InvalidRequest(
            f"{param}: every tool name is a string of 1 to {MAX_NAME} characters", param=param
        )
    return tuple(value)


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise InvalidRequest(f"{param}: a configured tool server's name", param=param)
    return value


def _url(value: Any, param: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > 2048:
        raise InvalidRequest(f"{param}: a URL", param=param)
    return value


def barrel_servers(value: Any, param: str = "mcp_servers") -> tuple[ServerUse, ...]:
    """Barrel's `mcp_servers` field (Chat Completions, Ollama)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest(f"{param} must be a list of tool server names", param=param)
    uses: list[ServerUse] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            uses.append(ServerUse(_name(item, param)))
        elif isinstance(item, dict):
            uses.append(
                ServerUse(
                    _name(item.get("name"), f"{param}[{i}].name"),
                    tools=_names(item.get("allowed_tools"), f"{param}[{i}].allowed_tools"),
                )
            )
        else:
            raise InvalidRequest(f"{param}[{i}]: a server name or object", param=param)
    return _unique(uses, param)


def responses_server(tool: dict[str, Any], i: int) -> ServerUse:
    """One Responses `{"type": "mcp"}` tool."""
    param = f"tools[{i}]"
    approval = tool.get("require_approval", "never")
    if approval != "never":
        raise InvalidRequest(
            f'{param}.require_approval: only "never" is supported (Barrel has no approvals)',
            param=param,
        )
    if tool.get("connector_id") is not None:
        raise InvalidRequest(f"{param}.connector_id: connectors are not supported", param=param)
    return ServerUse(
        _name(tool.get("server_label"), f"{param}.server_label"),
        url=_url(tool.get("server_url"), f"{param}.server_url"),
        tools=_names(tool.get("allowed_tools"), f"{param}.allowed_tools"),
    )


def anthropic_servers(value: Any) -> tuple[ServerUse, ...]:
    """Anthropic's `mcp_servers` (the MCP connector)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequest("mcp_servers must be a list", param="mcp_servers")
    uses: list[ServerUse] = []
    for i, item in enumerate(value):
        param = f"mcp_servers[{i}]"
        if not isinstance(item, dict) or item.get("type", "url") != "url":
            raise InvalidRequest(f'{param}: an object of type "url"', param=param)
        config = item.get("tool_configuration")
        config = {} if config is None else config
        if not isinstance(config, dict):
            raise InvalidRequest(f"{param}.tool_configuration: an object", param=param)
        use = ServerUse(
            _name(item.get("name"), f"{param}.name"),
            url=_url(item.get("url"), f"{param}.url"),
            tools=_names(config.get("allowed_tools"), f"{param}.allowed_tools"),
        )
        enabled = config.get("enabled", True)
        if not isinstance(enabled, bool):
            raise InvalidRequest(f"{param}.tool_configuration.enabled: a boolean", param=param)
        if enabled:  # a disabled server is checked, not used
            uses.append(use)
    return _unique(uses, "mcp_servers")


def _unique(uses: list[ServerUse], param: str) -> tuple[ServerUse, ...]:
    names = [u.name for u in uses]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"{param}: a tool server is named twice", param=param)
    return tuple(uses)


def call_record(call: ServerCall, result: ServerResult | None) -> dict[str, Any]:
    """Barrel's field `server_tool_calls` (Chat Completions, Ollama): a server call and
    what it answered. Clients that do not know the field ignore it."""
    out: dict[str, Any] = {
        "id": call.id,
        "server": call.server,
        "name": call.name,
        "arguments": call.arguments,
    }
    if result is not None:
        out["output"] = result.result.output
        out["is_error"] = result.result.error
    return out


def server_round(calls: list[tuple[ToolCall, str]]) -> list[Message]:
    """A round of server calls as the conversation holds it: the assistant's calls, then
    a tool message with each result."""
    if not calls:
        return []
    out = [Message(role="assistant", tool_calls=tuple(c for c, _ in calls))]
    for call, output in calls:
        parts = (TextPart(output),) if output else ()
        out.append(Message(role="tool", parts=parts, tool_call_id=call.id, name=call.name))
    return out
