"""The tool the API tests call, in each dialect's shape."""

from __future__ import annotations

from typing import Any

DESCRIPTION = "Get the current weather in a city"
CITY: Any = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city"}},
    "required": ["city"],
}
# the tiny model's strings run on; a bound keeps its forced call short
SHORT_CITY: Any = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}


def function_tool(parameters: Any) -> Any:
    """OpenAI's (and Ollama's) shape."""
    return {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": parameters},
    }


WEATHER = function_tool(CITY)
SHORT = function_tool(SHORT_CITY)
