"""Typed application and request state."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from barrel.actors.lifecycle import Lifecycle
from barrel.actors.runtime import Runtime
from barrel.config import Config
from barrel.engine.residency import ResidencyTracker
from barrel.metrics import Metrics
from barrel.store.store import ModelStore

CONFIG = web.AppKey("config", Config)
RUNTIME = web.AppKey("runtime", Runtime)
METRICS = web.AppKey("metrics", Metrics)
STORE = web.AppKey("store", ModelStore)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
RESIDENCY = web.AppKey("residency", ResidencyTracker)
# Called (on the loop) when the daemon cannot go on: the tree failed to boot or its root
# crashed. `barrel serve` shuts down and exits 1; tests may watch it.
ON_FATAL: web.AppKey[Callable[[str], None]] = web.AppKey("on_fatal")
# Called (on the loop) once the tree is up: `barrel serve` tells systemd READY=1.
ON_READY: web.AppKey[Callable[[], None]] = web.AppKey("on_ready")

REQUEST_ID = web.RequestKey("request_id", str)
