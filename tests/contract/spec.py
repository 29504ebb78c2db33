"""openapi.yaml read as data: its operations, their examples and schemas, a JSON Schema
validator for any part of it, and its event-stream frames."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.contract.live import SPEC

METHODS = ("get", "post", "delete", "head", "put")
BASE = "urn:barrel:openapi"


@cache
def spec() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(SPEC.read_text())
    return loaded


def _pointer(parts: tuple[str, ...]) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def validator(*where: str) -> Draft202012Validator:
    """A validator for the schema at `where` (a path of keys into openapi.yaml), its
    references resolved against the whole document."""
    registry: Registry[Any] = Registry().with_resource(
        BASE, Resource.from_contents(spec(), default_specification=DRAFT202012)
    )
    return Draft202012Validator({"$ref": f"{BASE}#/{_pointer(where)}"}, registry=registry)


def resolve(node: Any) -> Any:
    """Follow a local $ref (responses, request bodies)."""
    while isinstance(node, dict) and "$ref" in node:
        target: Any = spec()
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        node = target
    return node


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    body: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.body["operationId"])

    @property
    def request(self) -> dict[str, Any] | None:
        body = resolve(self.body.get("requestBody"))
        return body if isinstance(body, dict) else None

    @property
    def request_example(self) -> Any:
        request = self.request
        if request is None:
            return None
        (media,) = request["content"].values()
        return media.get("example")

    @property
    def request_media(self) -> str | None:
        request = self.request
        return next(iter(request["content"])) if request else None

    @property
    def path_examples(self) -> dict[str, Any]:
        params = [
            *spec()["paths"][self.path].get("parameters", []),
            *self.body.get("parameters", []),
        ]
        return {p["name"]: p["example"] for p in params if p["in"] == "path"}

    def success(self) -> tuple[str, dict[str, Any]]:
        for status, response in self.body["responses"].items():
            if str(status).startswith("2"):
                return str(status), resolve(response)
        raise AssertionError(f"{self.id} documents no success")

    def where(self, status: str) -> tuple[str, ...]:
        """The keys that lead to a response (through a components reference if any)."""
        response = self.body["responses"][status]
        if isinstance(response, dict) and "$ref" in response:
            return tuple(response["$ref"].removeprefix("#/").split("/"))
        return ("paths", self.path, self.method, "responses", status)


def operations() -> Iterator[Operation]:
    for path, item in spec()["paths"].items():
        for method in METHODS:
            if method in item:
                yield Operation(path, method, item[method])


def operation(op_id: str) -> Operation:
    return next(op for op in operations() if op.id == op_id)


def sse_data(text: str) -> list[tuple[str, str]]:
    """(event, data) of each event of an SSE answer (comments left out)."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        event, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            out.append((event, "\n".join(data)))
    return out


def ndjson(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
