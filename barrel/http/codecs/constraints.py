"""The fields by which clients ask for structured output, read into one neutral `Format`:
OpenAI's `response_format` (with llama-server's `schema` inside `json_object`),
llama-server's top-level `json_schema` and `grammar` (GBNF or Lark), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`), and
Anthropic's `output_config.format` (and its beta `output_format`).

A request names at most one of them; none is ever ignored: what cannot be read is a 400
naming the field. Whether the grammar compiles is the pipeline's question
(barrel.pipeline.formats)."""

from __future__ import annotations

import json
from typing import Any

from barrel.errors import InvalidRequest
from barrel.pipeline.request import Format

TEXT = Format()
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def response_format(fmt: dict[str, Any] | None, param: str = "response_format") -> Format:
    """OpenAI's `response_format`: text, json_object (llama-server: with an optional
    `schema`) or json_schema."""
    if fmt is None:
        return TEXT
    kind = fmt.get("type")
    if kind == "text":
        return TEXT
    if kind == "json_object":
        schema = fmt.get("schema")
        return Format("json_object") if schema is None else _schema(schema, f"{param}.schema")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(f"{param}.json_schema must be an object", param=param)
        return _schema(spec.get("schema", {}), f"{param}.json_schema.schema")
    raise InvalidRequest(f"{param}.type must be text, json_object or json_schema", param=param)


def structured_outputs(spec: Any) -> Format:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar and
    json_object (its other keys are options Barrel does not need)."""
    param = "structured_outputs"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    given = [k for k in _VLLM_KINDS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(f"{param} needs exactly one of {', '.join(_VLLM_KINDS)}", param=param)
    kind = given[0]
    value = spec[kind]
    where = f"{param}.{kind}"
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise InvalidRequest(f"{where} is not valid JSON", param=param) from None
        return _schema(value, where)
    if kind == "json_object":
        return Format("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise InvalidRequest(f"{where} must be a non-empty list of strings", param=param)
        return Format("choice", choices=tuple(value))
    if kind == "regex":
        return Format("regex", text=_text(value, where))
    return Format("grammar", text=_text(value, where))


def json_schema(value: Any) -> Format:
    """llama-server's top-level `json_schema`: the schema itself."""
    return TEXT if value is None else _schema(value, "json_schema")


def grammar(value: Any, param: str = "grammar") -> Format:
    """llama-server's `grammar`: GBNF (or Lark) text."""
    return Format("grammar", text=_text(value, param))


def anthropic(output_config: Any, output_format: Any) -> Format:
    """Anthropic's `output_config.format` (or the beta's top-level `output_format`):
    `{"type": "json_schema", "schema": ...}`."""
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    param = "output_config.format"
    if fmt is not None and output_format is not None:
        raise InvalidRequest("give output_config.format or output_format, not both")
    if fmt is None:
        fmt, param = output_format, "output_format"
    if fmt is None:
        return TEXT
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest(f'{param}.type must be "json_schema"')
    return _schema(fmt.get("schema"), f"{param}.schema")


def one_of(**formats: Format) -> Format:
    """The one structured-output field a request set (a 400 if it set several)."""
    given = {name: f for name, f in formats.items() if f.kind != "text"}
    if len(given) > 1:
        raise InvalidRequest(f"give one of {', '.join(given)}, not several")
    return next(iter(given.values()), TEXT)


def _schema(schema: Any, where: str) -> Format:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be an object", param=where.split(".")[0])
    return Format("json_schema", schema)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{where} must be a non-empty string", param=where.split(".")[0])
    return value
