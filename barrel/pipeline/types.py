"""The neutral request and event types the dialects speak to, re-exported from where
they are defined, so HTTP depends on the pipeline and never on the engine."""

from __future__ import annotations

from barrel.engine.types import (
    Delta,
    Done,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SessionId,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Delta",
    "Done",
    "FinishReason",
    "GenerationRequest",
    "SamplingParams",
    "SessionId",
    "TokenLogprob",
    "Usage",
]
