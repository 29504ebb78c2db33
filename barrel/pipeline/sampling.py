"""Sampling defaults belong to the dialect and to the model.

From weakest to strongest:

1. the dialect's documented defaults: Ollama's (temperature 0.8, top_k 40, top_p 0.9,
   repeat_penalty 1.1 over the last 64 tokens) for Ollama requests; OpenAI's and
   Anthropic's (temperature 1.0, top_p 1.0, no top_k, no repeat, presence or frequency
   penalty) for theirs: those APIs never apply a repeat penalty, which would punish the
   braces and quotes of JSON and tool calls;
2. for the OpenAI and Anthropic dialects, what the model's authors recommend in the GGUF
   (`general.sampling.*`, as llama.cpp reads them);
3. the model's stored PARAMETERs (Modelfile, `/api/create`, `/api/edit`);
4. the request's own fields.
"""

from __future__ import annotations

from typing import Any

from barrel.engine.types import SamplingParams
from barrel.errors import InvalidRequest
from barrel.pipeline.request import Dialect

_NEUTRAL: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,  # off
    "top_p": 1.0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.0,
    "repeat_last_n": 64,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

DEFAULTS: dict[Dialect, dict[str, Any]] = {
    # https://github.com/ollama/ollama/blob/main/docs/modelfile.md (valid parameters)
    Dialect.OLLAMA: {**_NEUTRAL, "temperature": 0.8, "top_k": 40, "top_p": 0.9,
                     "repeat_penalty": 1.1},
    Dialect.OPENAI: dict(_NEUTRAL),
    Dialect.ANTHROPIC: dict(_NEUTRAL),
}  # fmt: skip

# GGUF keys with the model's recommended sampling -> Barrel's (Ollama's) option names.
GGUF_SAMPLING: dict[str, tuple[str, type]] = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.min_p": ("min_p", float),
    "general.sampling.penalty_repeat": ("repeat_penalty", float),
    "general.sampling.penalty_last_n": ("repeat_last_n", int),
    "general.sampling.mirostat": ("mirostat", int),
    "general.sampling.mirostat_tau": ("mirostat_tau", float),
    "general.sampling.mirostat_eta": ("mirostat_eta", float),
}


def recommended(meta: dict[str, str]) -> dict[str, Any]:
    """The GGUF's `general.sampling.*` values that parse, as option names."""
    out: dict[str, Any] = {}
    for key, (name, kind) in GGUF_SAMPLING.items():
        raw = meta.get(key)
        if raw is None:
            continue
        try:
            out[name] = kind(float(raw)) if kind is int else kind(raw)
        except (TypeError, ValueError):
            continue  # a malformed key is ignored, not fatal
    return out


def effective(
    dialect: Dialect,
    request: dict[str, Any],
    parameters: dict[str, Any],
    model_recommends: dict[str, Any],
) -> dict[str, Any]:
    """The options a request samples with (see the module's order)."""
    merged = dict(DEFAULTS[dialect])
    if dialect is not Dialect.OLLAMA:
        merged.update(model_recommends)
    merged.update(parameters)
    merged.update(request)
    return merged


def sampling_params(o: dict[str, Any]) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    """Merged options -> the engine's sampling parameters, the token limit (None: no
    limit) and the stop strings. Bad values are a 400."""
    try:
        seed = o.get("seed")
        sampling = SamplingParams(
            temperature=float(o["temperature"]),
            top_k=int(o["top_k"]),
            top_p=float(o["top_p"]),
            min_p=float(o["min_p"]),
            typical_p=float(o["typical_p"]),
            repeat_penalty=float(o["repeat_penalty"]),
            presence_penalty=float(o.get("presence_penalty", 0.0)),
            frequency_penalty=float(o.get("frequency_penalty", 0.0)),
            penalty_last_n=int(o["repeat_last_n"]),
            seed=int(seed) if seed is not None and int(seed) >= 0 else None,
            mirostat=int(o.get("mirostat", 0)),
            mirostat_tau=float(o.get("mirostat_tau", 5.0)),
            mirostat_eta=float(o.get("mirostat_eta", 0.1)),
            dry_multiplier=float(o.get("dry_multiplier", 0.0)),
        )
        predict = int(o.get("num_predict", -1))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"invalid option: {exc}") from None
    stop = o.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    return sampling, (predict if predict > 0 else None), tuple(str(s) for s in stop)
