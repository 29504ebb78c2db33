"""Typed application and request state."""

from __future__ import annotations

from aiohttp import web

from barrel.actors.models import Models
from barrel.config import Config
from barrel.metrics import Metrics

CONFIG = web.AppKey("config", Config)
METRICS = web.AppKey("metrics", Metrics)
# The facade: model sessions, management, status and readiness.
MODELS = web.AppKey("models", Models)

REQUEST_ID = web.RequestKey("request_id", str)
# The API key the request authenticated with (auth on): scopes its KV cache reuse.
API_KEY = web.RequestKey("api_key", bytes)
