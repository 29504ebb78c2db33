"""Request limits every generation endpoint checks before any slow work."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from barrel.errors import InvalidRequest
from barrel.http.keys import CONFIG


def check_limits(request: web.Request, messages: list[Any], tools: list[Any]) -> None:
    limits = request.app[CONFIG].limits
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are allowed")
    if len(tools) > limits.max_tools:
        raise InvalidRequest(f"at most {limits.max_tools} tools are allowed")
