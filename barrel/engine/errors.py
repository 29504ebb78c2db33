"""Typed engine failures, rendered by the HTTP layer like any `BarrelError`."""

from __future__ import annotations

from barrel.errors import BarrelError, InvalidRequest, Unavailable


class ModelLoadError(BarrelError):
    status = 500
    code = "model_load_failed"


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class InvalidGrammar(InvalidRequest):
    code = "invalid_grammar"


class EngineCrashed(Unavailable):
    """The engine thread died; the request was in flight. Its supervisor restarts it."""

    code = "engine_crashed"


class EngineStopped(Unavailable):
    code = "engine_stopped"


class KVCacheFull(Unavailable):
    """No room in the KV cache even after evicting every parked sequence."""

    code = "kv_cache_full"
