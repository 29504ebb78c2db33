"""What OpenAI's chat completions, completions and responses codecs share: the body's
sampling knobs and their checks, usage and logprobs in OpenAI's shapes, the error frame."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from barrel import __version__
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import Comment, Data, constraints, read_body
from barrel.http.codecs.constraints import TEXT
from barrel.http.errors import error_body
from barrel.pipeline.events import Finished
from barrel.pipeline.request import Dialect, Format, Options
from barrel.values import TokenLogprob, Usage

MAX_N = 8  # choices per request (each one is a sequence of the engine)
MAX_TOP_LOGPROBS = 20


class LoraEntry(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    scale: float = 0.0


MAX_LORA_ENTRIES = 64


def format_of(k: Knobs) -> Format:
    """The one structured-output field the request set (a 400 for several)."""
    return constraints.one_of(
        response_format=constraints.response_format(k.response_format),
        json_schema=constraints.json_schema(k.json_schema),
        grammar=TEXT if k.grammar is None else constraints.grammar(k.grammar),
        structured_outputs=TEXT
        if k.structured_outputs is None
        else constraints.structured_outputs(k.structured_outputs),
    )


def lora_of(k: Knobs) -> tuple[tuple[int, float], ...] | None:
    """The request's (adapter id, scale) pairs, None when it names none."""
    if k.lora is None:
        return None
    if len(k.lora) > MAX_LORA_ENTRIES:
        raise InvalidRequest(f"lora: at most {MAX_LORA_ENTRIES} entries", param="lora")
    return tuple((e.id, e.scale) for e in k.lora)


FINGERPRINT = f"barrel-{__version__}"  # OpenAI's system_fingerprint


class Knobs(msgspec.Struct, kw_only=True):
    """Fields chat completions, completions and responses have in common. Unknown fields
    are ignored, as OpenAI-compatible servers do (store, metadata, service_tier, ...)."""

    model: str = ""
    temperature: float | None = None
    top_p: float | None = None
    # llama-server's extensions
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # llama-server's per-request LoRA adapters: [{id, scale}], the others at scale 0
    lora: list[LoraEntry] | None = None
    # vLLM's and llama-server's: generate past end-of-generation tokens (benchmarks)
    ignore_eos: bool = False
    # structured output beside OpenAI's response_format (barrel.http.codecs.constraints):
    # llama-server's json_schema and grammar, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    json_schema: Any = None
    grammar: Any = None
    structured_outputs: Any = None


B = TypeVar("B", bound=msgspec.Struct)
_AT = re.compile(r" - at `\$\.?([^`]*)`$")


def decode_json(raw: bytes, kind: type[B]) -> B:
    """The body as `kind` (barrel.http.codecs.read_body); a 400 naming the field at fault
    (OpenAI's `param`)."""
    try:
        body = read_body(raw, kind)
    except msgspec.ValidationError as exc:  # a DecodeError too: first
        text = str(exc)
        m = _AT.search(text)
        raise InvalidRequest(f"invalid request: {text}", param=m.group(1) if m else None) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not getattr(body, "model", ""):
        raise InvalidRequest("you must provide a model parameter", param="model")
    return body


def finish_reason(fin: Finished) -> str:
    """OpenAI's: "length" also for a full context window, as OpenAI says it."""
    return {"cancelled": "stop", "context": "length"}.get(fin.reason, fin.reason)


def _between(value: float | None, low: float, high: float, param: str) -> None:
    if value is not None and not low <= value <= high:
        raise InvalidRequest(f"{param} must be between {low:g} and {high:g}", param=param)


def check_knobs(k: Knobs) -> None:
    """Everything about the knobs that can be checked before a lease."""
    _between(k.temperature, 0.0, 2.0, "temperature")
    _between(k.top_p, 0.0, 1.0, "top_p")
    _between(k.presence_penalty, -2.0, 2.0, "presence_penalty")
    _between(k.frequency_penalty, -2.0, 2.0, "frequency_penalty")
    if not 1 <= k.n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    if k.max_tokens is not None and k.max_tokens < 0:
        raise InvalidRequest("max_tokens must not be negative", param="max_tokens")
    for key, bias in (k.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(f"logit_bias keys are token ids, not {key!r}", param="logit_bias")
        _between(bias, -100.0, 100.0, "logit_bias")


def options_of(k: Knobs) -> Options:
    stop = None if k.stop is None else (k.stop,) if isinstance(k.stop, str) else tuple(k.stop)
    return Options(
        temperature=k.temperature,
        top_p=k.top_p,
        top_k=k.top_k,
        min_p=k.min_p,
        repeat_penalty=k.repeat_penalty,
        seed=k.seed,
        presence_penalty=k.presence_penalty,
        frequency_penalty=k.frequency_penalty,
        stop=stop,
    )


def logit_bias_of(k: Knobs) -> dict[int, float]:
    return {int(t): float(b) for t, b in (k.logit_bias or {}).items()}


def include_usage(k: Knobs) -> bool:
    return bool((k.stream_options or {}).get("include_usage"))


def usage_of(usages: list[Usage]) -> dict[str, Any]:
    """Usage of one request; with several choices the prompt counts once."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.prompt_reused},
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def token_logprobs(lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat completions' (and responses') logprobs.content entries."""
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "bytes": _bytes(lp.text),
            "top_logprobs": [
                {"token": t.text, "logprob": t.logprob, "bytes": _bytes(t.text)} for t in lp.top
            ],
        }
        for lp in lps
    ]


def error_frame(err: BarrelError) -> Data:
    """A stream that began ends with an error in OpenAI's envelope (and no [DONE])."""
    envelope = error_body(
        Dialect.OPENAI, err.status, err.code, err.message_for("openai"), err.param
    )
    assert isinstance(envelope, dict)
    return Data(envelope)


def progress(position: int | None, loading_s: float | None) -> list[Comment]:
    """SSE comments while a stream waits: clients skip them; proxies see traffic."""
    if position is not None:
        return [Comment(f"queued, position {position}")]
    if loading_s is not None:
        return [Comment(f"loading the model, {loading_s:.0f}s")]
    return []
