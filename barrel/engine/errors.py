"""Typed engine failures, rendered by the HTTP layer like any `BarrelError`."""

from __future__ import annotations

from barrel.errors import BarrelError, InvalidRequest, Unavailable


class ModelLoadError(BarrelError):
    """A model file that llama.cpp could not load."""

    status = 500
    code = "model_load_failed"


class PromptTooLong(InvalidRequest):
    """A prompt longer than the context holds, with the counts each dialect words its error
    from."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, tokens: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.limit = limit

    def message_for(self, dialect: str) -> str:
        """OpenAI's (its current models') and Anthropic's own wordings, which clients
        look for: litellm's context-window fallbacks, LangChain's ContextOverflowError."""
        if not self.limit:
            return self.message
        if dialect == "openai":
            return (
                f"Input tokens exceed the configured limit of {self.limit} tokens. Your "
                f"messages resulted in {self.tokens} tokens. Please reduce the length of "
                "the messages."
            )
        if dialect == "anthropic":
            return f"prompt is too long: {self.tokens} tokens > {self.limit - 1} maximum"
        return self.message


class InvalidGrammar(InvalidRequest):
    """A grammar llguidance refused to compile."""

    code = "invalid_grammar"


class EngineCrashed(Unavailable):
    """The engine thread died; the request was in flight. Its supervisor restarts it."""

    code = "engine_crashed"


class EngineStopped(Unavailable):
    """The engine was stopped (unload, shutdown) before or while the request ran."""

    code = "engine_stopped"


class KVCacheFull(Unavailable):
    """No room in the KV cache even after evicting every parked sequence."""

    code = "kv_cache_full"
