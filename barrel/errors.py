"""The one exception root of Barrel.

Every failure a caller is meant to handle derives from `BarrelError` and carries what
the HTTP layer needs to render it in any dialect: an HTTP status, a stable machine code
and a human message. Anything else raised inside an actor is a bug and is handled as
"let it crash" (see `barrel.actors.child`).
"""

from __future__ import annotations


class BarrelError(Exception):
    """Base of every expected Barrel failure."""

    status: int = 500
    code: str = "internal_error"

    def __init__(
        self, message: str, *, retry_after: float | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.param = param  # the request field at fault, when one is (OpenAI's "param")

    def message_for(self, dialect: str) -> str:
        """The message in the words a dialect's clients recognise ("openai",
        "anthropic", "ollama"): the same for most errors."""
        return self.message


class InvalidRequest(BarrelError):
    status = 400
    code = "invalid_request"


class Unauthorized(BarrelError):
    status = 401
    code = "unauthorized"


class Forbidden(BarrelError):
    status = 403
    code = "forbidden"


class NotFound(BarrelError):
    status = 404
    code = "not_found"


class Conflict(BarrelError):
    status = 409
    code = "conflict"


class UnsupportedMediaType(BarrelError):
    status = 415
    code = "unsupported_media_type"


class PayloadTooLarge(BarrelError):
    status = 413
    code = "request_too_large"


class Unavailable(BarrelError):
    """A part of the daemon that would serve the request is not running."""

    status = 503
    code = "unavailable"


class CallTimeout(BarrelError):
    """A cross-thread call did not answer within its timeout."""

    status = 504
    code = "timeout"


class ConfigError(BarrelError):
    """The configuration is invalid; the daemon refuses to start (exit code 2)."""

    status = 500
    code = "config_error"
