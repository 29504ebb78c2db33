"""Middlewares, outermost first: access log, errors, host check, CORS preflight, auth,
body cap. Response headers every response needs (X-Request-ID, CORS) are added in
`on_response_prepare`, so streams and error responses get them too."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from barrel.config import Config
from barrel.errors import (
    BarrelError,
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)
from barrel.http import errors
from barrel.http.keys import API_KEY, CONFIG, METRICS, REQUEST_ID
from barrel.http.limits import json_depth

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("barrel.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_UNAUTHENTICATED_PATHS = frozenset({"/health", "/health/ready"})
# Polled by monitors: not "recent requests" in /api/status.
_QUIET_PATHS = frozenset({"/health", "/health/ready", "/metrics", "/api/status"})


def _route_label(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    incoming = request.headers.get("X-Request-ID", "")
    if not _REQUEST_ID_OK.match(incoming):
        incoming = f"req_{secrets.token_hex(8)}"
    request[REQUEST_ID] = incoming
    start = time.perf_counter()
    status = 499  # the client went away before an answer
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        elapsed = time.perf_counter() - start
        route = _route_label(request)
        metrics = request.app[METRICS]
        metrics.http_requests.labels(request.method, route, str(status)).inc()
        metrics.http_duration.labels(route).observe(elapsed)
        if request.path not in _QUIET_PATHS:
            metrics.recent.append(
                {
                    "time": time.time(),
                    "method": request.method,
                    "path": request.path,
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 1),
                    "request_id": request[REQUEST_ID],
                }
            )
        if request.app[CONFIG].server.access_log:
            access_logger.info(
                '%s "%s %s HTTP/%d.%d" %d %.1fms %s',
                request.remote,
                request.method,
                request.path_qs,
                request.version.major,
                request.version.minor,
                status,
                elapsed * 1000,
                request[REQUEST_ID],
            )


@web.middleware
async def error_envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BarrelError as err:
        return errors.render(request.path, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        resp = errors.error_response(request.path, exc.status, code, message)
        if exc.status == 405 and "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return errors.error_response(request.path, 500, "internal_error", "internal server error")


def _is_loopback_host(host: str) -> bool:
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    if value.startswith("["):  # [::1]:8080
        return value[: value.find("]") + 1] if "]" in value else value
    if value.count(":") == 1:
        return value.rsplit(":", 1)[0]
    return value


@web.middleware
async def host_check(request: web.Request, handler: Handler) -> web.StreamResponse:
    """While bound to loopback, refuse requests whose Host is not a loopback name: a web
    page on another origin could otherwise reach the daemon through DNS rebinding."""
    if _is_loopback_host(request.app[CONFIG].server.host):
        host = request.headers.get("Host")
        if host is not None and not _is_loopback_host(_split_host(host)):
            raise Forbidden(f"host {host!r} is not allowed while bound to a loopback address")
    return await handler(request)


def _origin_allowed(config: Config, origin: str) -> bool:
    allowed = config.cors.allow_origins
    return "*" in allowed or origin in allowed


@web.middleware
async def cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    config = request.app[CONFIG]
    origin = request.headers.get("Origin")
    if (
        not config.cors.allow_origins
        or request.method != "OPTIONS"
        or origin is None
        or "Access-Control-Request-Method" not in request.headers
    ):
        return await handler(request)
    if not _origin_allowed(config, origin):
        raise Forbidden(f"origin {origin!r} is not allowed")
    method = request.headers["Access-Control-Request-Method"].upper()
    if method not in config.cors.allow_methods:
        raise Forbidden(f"method {method} is not allowed by CORS")
    requested = request.headers.get("Access-Control-Request-Headers", "")
    if "*" in config.cors.allow_headers:
        allow_headers = requested
    else:
        allow_headers = ", ".join(config.cors.allow_headers)
    headers = {
        "Access-Control-Allow-Methods": ", ".join(config.cors.allow_methods),
        "Access-Control-Max-Age": str(config.cors.max_age_s),
    }
    if allow_headers:
        headers["Access-Control-Allow-Headers"] = allow_headers
    return web.Response(status=204, headers=headers)


UNSAFE_METHODS = frozenset(("POST", "PUT", "PATCH", "DELETE"))
# Audio uploads (barrel.http.openai_audio): multipart forms read part by part, each part
# bounded there; the whole body may hold a clip of `limits.max_audio_bytes` and its fields.
AUDIO_UPLOADS = frozenset(
    (
        "/v1/audio/transcriptions",
        "/audio/transcriptions",
        "/v1/audio/translations",
        "/audio/translations",
    )
)
AUDIO_FORM_SLACK = 1024 * 1024
# Origins a local tool's page may have, allowed as Ollama allows them by default.
_LOCAL_ORIGIN = re.compile(
    r"^(https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?"
    r"|(app|file|tauri|vscode-webview|vscode-file)://.*)$"
)


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


@web.middleware
async def origin_check(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A web page in the user's browser may not change anything: a request that carries
    an Origin (browsers always send it on cross-origin requests) must come from an
    allowed origin (`cors.allow_origins`, or a local tool's page), and send JSON as JSON,
    which a page cannot do without a CORS preflight (an audio upload is a form, from an
    allowed page only). Clients without an Origin (SDKs,
    curl, whose -d sends a form content type) are not concerned."""
    origin = request.headers.get("Origin")
    if origin is None or request.method not in UNSAFE_METHODS:
        return await handler(request)
    config = request.app[CONFIG]
    if not (_origin_allowed(config, origin) or _LOCAL_ORIGIN.match(origin)):
        raise Forbidden(f"requests from a page at {origin!r} are not allowed (cors.allow_origins)")
    # an allowed page's audio upload is a form (barrel.http.openai_audio)
    form = request.path in AUDIO_UPLOADS and request.content_type == "multipart/form-data"
    if not (request.path.startswith("/api/blobs/") or form or _is_json(request.content_type)):
        raise UnsupportedMediaType(
            f"a browser request must send JSON as application/json, not {request.content_type}"
        )
    return await handler(request)


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[CONFIG].auth.api_keys
    if not keys or request.path in _UNAUTHENTICATED_PATHS or request.method == "OPTIONS":
        return await handler(request)
    presented = request.headers.get("x-api-key", "")
    authorization = request.headers.get("Authorization", "")
    if authorization[:7].lower() == "bearer ":
        presented = authorization[7:].strip()
    if not presented:
        raise Unauthorized("missing API key (Authorization: Bearer <key>)")
    # Headers arrive as latin-1 text: compare the bytes that were sent, whatever they are.
    sent = presented.encode("latin-1", errors="replace")
    if not any(hmac.compare_digest(sent, k.encode()) for k in keys):
        raise Unauthorized("invalid API key")
    request[API_KEY] = sent
    return await handler(request)


@web.middleware
async def body_cap(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a declared oversize body before anything reads it. A chunked body without
    Content-Length hits the same cap (`client_max_size`) when the handler reads it."""
    if request.path.startswith("/api/blobs/"):
        return await handler(request)  # model uploads are streamed to disk, not read whole
    limits = request.app[CONFIG].limits
    cap = limits.max_request_body_bytes
    upload = request.path in AUDIO_UPLOADS  # a multipart form, read part by part
    if upload:
        cap = max(cap, limits.max_audio_bytes + AUDIO_FORM_SLACK)
    if request.content_length is not None and request.content_length > cap:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the limit of {cap} bytes"
        )
    if upload:
        return await handler(request)
    # Read once here (aiohttp keeps it for the handler): a body nested deeper than any
    # request needs is a 400 before a parser recurses into it.
    if (
        request.method in UNSAFE_METHODS
        and request.can_read_body
        and json_depth(await request.read()) > limits.max_json_depth
    ):
        raise InvalidRequest(f"the JSON body nests deeper than {limits.max_json_depth} levels")
    return await handler(request)


async def decorate_response(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: X-Request-ID and CORS headers on every response."""
    request_id = request.get(REQUEST_ID)
    if request_id:
        response.headers["X-Request-ID"] = request_id
    config = request.app[CONFIG]
    origin = request.headers.get("Origin")
    if config.cors.allow_origins and origin and _origin_allowed(config, origin):
        response.headers["Access-Control-Allow-Origin"] = (
            "*" if config.cors.allow_origins == ["*"] else origin
        )
        response.headers["Access-Control-Expose-Headers"] = "X-Request-ID, Retry-After"
        response.headers.add("Vary", "Origin")


MIDDLEWARES = [
    access_log,
    error_envelope,
    host_check,
    cors_preflight,
    origin_check,
    auth,
    body_cap,
]
