"""schemathesis hooks (SCHEMATHESIS_HOOKS=tests.contract.hooks): Ollama's NDJSON streams,
read a line at a time. Every line but the last is checked here against the schema the
media type documents (one line); the last is handed back for schemathesis' own check."""

from __future__ import annotations

import json
from typing import Any

import schemathesis

NDJSON = "application/x-ndjson"


def lines_of(content: bytes) -> list[Any]:
    out = []
    for n, line in enumerate(content.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"NDJSON line {n} is not JSON: {exc}") from None
    if not out:
        raise ValueError("an NDJSON answer with no lines")
    return out


@schemathesis.deserializer(NDJSON)
def ndjson(ctx: schemathesis.DeserializationContext, response: Any) -> Any:
    lines = lines_of(response.content)
    documented = ctx.operation.responses.find_by_status_code(response.status_code)
    if documented is not None:
        resolved = documented.get_schema(NDJSON)
        if resolved.schema is not None:
            validator = documented.get_validator(resolved.media_type, resolved.schema)
            for n, line in enumerate(lines[:-1], 1):
                errors = list(validator.iter_errors(line)) if validator else []
                if errors:
                    raise ValueError(f"NDJSON line {n} does not match its schema: {errors[0]}")
    return lines[-1]


@schemathesis.hook
def map_case(ctx: schemathesis.HookContext, case: Any) -> Any:
    """The stateful phase follows createResponse's links to GET and DELETE the response
    it made, which holds only for stored responses: `store: false` (OpenAI's way of
    asking for none, answered 404 later, as it should be) is left to the other phases."""
    phase = getattr(getattr(getattr(case, "meta", None), "phase", None), "name", "")
    body = case.body
    if (
        str(phase).lower() == "stateful"
        and case.operation.label == "POST /v1/responses"
        and isinstance(body, dict)
        and body.get("store") is False
    ):
        case.body = {k: v for k, v in body.items() if k != "store"}
    return case
