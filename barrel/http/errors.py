"""Errors rendered in the dialect of the endpoint that failed — the one place that does it.

OpenAI: {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
Ollama: {"error": "message"}
Barrel's own endpoints: {"error": {"code", "message"}}
"""

from __future__ import annotations

from aiohttp import web

from barrel.errors import BarrelError
from barrel.pipeline.request import Dialect

__all__ = ["Dialect", "dialect_for", "error_body"]

LLAMA_SERVER_PATHS = frozenset({"/tokenize", "/detokenize", "/rerank", "/reranking"})
# OpenAI's routes without their /v1 (llama-server and vLLM serve both; an SDK whose base
# URL has no /v1 asks for these).
OPENAI_UNPREFIXED = frozenset(
    {"/chat/completions", "/completions", "/embeddings", "/responses", "/models"}
)


def dialect_for(path: str) -> Dialect:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return Dialect.ANTHROPIC
    if (
        path.startswith(("/v1/", "/models/", "/responses/"))
        or path in LLAMA_SERVER_PATHS
        or path in OPENAI_UNPREFIXED
    ):
        return Dialect.OPENAI  # llama-server's own endpoints answer like OpenAI
    if path.startswith("/api/"):
        return Dialect.OLLAMA
    return Dialect.BARREL


_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _openai_type(status: int) -> str:
    if status in _OPENAI_TYPES:
        return _OPENAI_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(
    dialect: Dialect, status: int, code: str, message: str, param: str | None = None
) -> object:
    if dialect is Dialect.OPENAI:
        return {
            "error": {
                "message": message,
                "type": _openai_type(status),
                "param": param,
                "code": code,
            }
        }
    if dialect is Dialect.ANTHROPIC:
        fallback = "api_error" if status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_TYPES.get(status, fallback)
        return {"type": "error", "error": {"type": kind, "message": message}}
    if dialect is Dialect.OLLAMA:
        return {"error": message}
    return {"error": {"code": code, "message": message}}


def error_response(
    path: str,
    status: int,
    code: str,
    message: str,
    retry_after: float | None = None,
    param: str | None = None,
) -> web.Response:
    dialect = dialect_for(path)
    if dialect is Dialect.ANTHROPIC and status == 503:
        status = 529  # Anthropic's SDKs back off on "overloaded"
    resp = web.json_response(error_body(dialect, status, code, message, param), status=status)
    if retry_after is not None:
        resp.headers["Retry-After"] = str(max(1, round(retry_after)))
    return resp


def render(path: str, err: BarrelError) -> web.Response:
    message = err.message_for(dialect_for(path).value)
    return error_response(path, err.status, err.code, message, err.retry_after, err.param)
