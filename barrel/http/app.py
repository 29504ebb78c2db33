"""The aiohttp application: routes, middlewares and app keys over daemon-built services."""

from __future__ import annotations

import logging

from aiohttp import web

from barrel.config import Config
from barrel.http import (
    anthropic,
    debug,
    health,
    ollama_gen,
    ollama_models,
    openai_audio,
    openai_chat,
    openai_completions,
    openai_models,
    openai_responses,
    rerank,
    status,
)
from barrel.http.keys import CONFIG, METRICS, MODELS
from barrel.http.middlewares import MIDDLEWARES, decorate_response
from barrel.http.response_store import ResponseStore
from barrel.services import Services

logger = logging.getLogger(__name__)


def make_app(config: Config, services: Services) -> web.Application:
    """Routes, middlewares and keys; the services (and their tree) are the caller's to
    start and stop (`barrel.services.running`)."""
    app = web.Application(
        middlewares=MIDDLEWARES,
        client_max_size=config.limits.max_request_body_bytes,
    )
    app[CONFIG] = config
    app[METRICS] = services.metrics
    app[MODELS] = services.models
    app[openai_responses.STORE] = ResponseStore(
        config.responses.store_ttl_s, config.responses.max_stored
    )
    app.on_response_prepare.append(decorate_response)
    for module in (
        health,
        ollama_models,
        ollama_gen,
        anthropic,
        openai_audio,
        openai_chat,
        openai_completions,
        openai_models,
        openai_responses,
        rerank,
        status,
    ):
        app.router.add_routes(module.routes)
    if config.server.fault_injection:
        app.router.add_routes(debug.routes)
    return app
