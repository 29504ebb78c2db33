"""openapi.yaml documents every route the daemon serves, with the bounds the daemon
enforces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from barrel.config import Config, LimitsConfig
from barrel.http.codecs.ollama import MAX_TOP_LOGPROBS as OLLAMA_TOP_LOGPROBS
from barrel.http.codecs.openai_common import MAX_LORA_ENTRIES, MAX_N, MAX_TOP_LOGPROBS
from barrel.http.codecs.openai_completions import MAX_LOGPROBS
from barrel.store.names import MAX_NAME
from tests.apps import app_for

REPO = Path(__file__).resolve().parents[1]


def test_every_route_is_documented() -> None:
    spec = yaml.safe_load((REPO / "openapi.yaml").read_text())
    assert spec["openapi"].startswith("3.1")
    documented = {
        (alias, method.upper())
        for path, ops in spec["paths"].items()
        for alias in [path, *ops.get("x-aliases", [])]  # the same operations at another path
        for method in ops
        if method in ("get", "post", "delete", "head", "put")
    }
    app = app_for(Config())
    served = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if route.method in ("HEAD", "OPTIONS") and (path, "GET") in documented:
            continue
        served.add((path, route.method))
    missing = served - documented
    assert not missing, f"undocumented routes: {sorted(missing)}"


def test_the_rerank_aliases_are_one_handler() -> None:
    """The contract run fuzzes /v1/rerank only (tests/contract/schemathesis.toml): the
    other three paths are the same handler, with the same request and responses."""
    spec = yaml.safe_load((REPO / "openapi.yaml").read_text())
    paths = ["/v1/rerank", "/rerank", "/v1/reranking", "/reranking"]
    app = app_for(Config())
    handlers = {
        route.handler
        for route in app.router.routes()
        if route.resource is not None and route.resource.canonical in paths
    }
    assert len(handlers) == 1
    ops = [spec["paths"][p]["post"] for p in paths]
    assert all(op["requestBody"] == ops[0]["requestBody"] for op in ops)
    assert all(op["responses"] == ops[0]["responses"] for op in ops)


def _at(spec: dict[str, Any], *path: str | int) -> Any:
    node: Any = spec
    for part in path:
        node = node[part]
    return node


def test_the_schemas_bounds_are_the_daemons() -> None:
    """Every bound openapi.yaml states is the one the codecs enforce (the defaults of
    [limits] and the codecs' constants): a change to one fails here until both agree."""
    spec = yaml.safe_load((REPO / "openapi.yaml").read_text())
    schemas = spec["components"]["schemas"]
    limits = LimitsConfig()
    chat = _at(schemas, "ChatCompletionRequest", "allOf", 1, "properties")
    stated = {
        "stop strings": (_at(schemas, "StopStrings", "oneOf", 1, "maxItems"), limits.max_stop),
        "stop length": (
            _at(schemas, "StopStrings", "oneOf", 0, "maxLength"),
            limits.max_stop_length,
        ),
        "anthropic stops": (
            _at(schemas, "AnthropicFields", "properties", "stop_sequences", "maxItems"),
            limits.max_stop,
        ),
        "chat messages": (chat["messages"]["maxItems"], limits.max_messages),
        "chat tools": (chat["tools"]["maxItems"], limits.max_tools),
        "ollama messages": (
            _at(schemas, "ChatRequest", "allOf", 1, "properties", "messages", "maxItems"),
            limits.max_messages,
        ),
        "ollama tools": (
            _at(schemas, "ChatRequest", "allOf", 1, "properties", "tools", "maxItems"),
            limits.max_tools,
        ),
        "anthropic messages": (
            _at(schemas, "AnthropicFields", "properties", "messages", "maxItems"),
            limits.max_messages,
        ),
        "anthropic tools": (
            _at(schemas, "AnthropicFields", "properties", "tools", "maxItems"),
            limits.max_tools,
        ),
        "embedding inputs": (
            _at(schemas, "EmbeddingsRequest", "properties", "input", "oneOf", 2, "maxItems"),
            limits.max_embedding_inputs,
        ),
        "rerank documents": (
            _at(schemas, "RerankRequest", "properties", "documents", "maxItems"),
            limits.max_embedding_inputs,
        ),
        "prompts": (
            _at(
                schemas,
                "CompletionRequest",
                "allOf",
                1,
                "properties",
                "prompt",
                "oneOf",
                2,
                "maxItems",
            ),
            limits.max_sequences,
        ),
        "n": (_at(schemas, "OpenAISampling", "properties", "n", "maximum"), MAX_N),
        "top_logprobs": (chat["top_logprobs"]["maximum"], MAX_TOP_LOGPROBS),
        "ollama top_logprobs": (
            _at(schemas, "OllamaGenerationFields", "properties", "top_logprobs", "maximum"),
            OLLAMA_TOP_LOGPROBS,
        ),
        "completion logprobs": (
            _at(schemas, "CompletionRequest", "allOf", 1, "properties", "logprobs", "maximum"),
            MAX_LOGPROBS,
        ),
        "lora entries": (
            _at(schemas, "OpenAISampling", "properties", "lora", "maxItems"),
            MAX_LORA_ENTRIES,
        ),
        "model name": (_at(schemas, "ModelName", "maxLength"), MAX_NAME),
    }
    wrong = {k: v for k, v in stated.items() if v[0] != v[1]}
    assert not wrong, f"openapi.yaml (left) and the daemon (right) disagree: {wrong}"
