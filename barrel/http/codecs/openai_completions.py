"""OpenAI's legacy completions as a codec.

Requests decode into the neutral request with a `Completion`: the prompt as it is (a
string, strings, token ids or lists of token ids), each prompt with `n` choices (index =
prompt * n + choice); `suffix` asks for fill-in-the-middle; `echo` puts the prompt in
front of the text; with `logprobs` too (scoring a text, as evaluation harnesses do with
max_tokens 0) each prompt token gets its logprob (the first one null), without
streaming. Events encode as a `text_completion`, or as chunks of the same object ending
with `[DONE]`; logprobs in the legacy shape (tokens, token_logprobs, top_logprobs as
maps, text_offset into the choice's text).
"""

from __future__ import annotations

from typing import Any

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import DONE, STAMP, Begin, Data, Frame, Stamp
from barrel.http.codecs.openai_common import (
    FINGERPRINT,
    Knobs,
    check_knobs,
    decode_json,
    error_frame,
    finish_reason,
    format_of,
    include_usage,
    logit_bias_of,
    lora_of,
    options_of,
    progress,
)
from barrel.pipeline.events import ChatEvent, Finished, TextDelta
from barrel.pipeline.request import ApiRequest, Completion, Dialect
from barrel.values import TokenLogprob, Usage

MAX_LOGPROBS = 20


class CompletionBody(Knobs, kw_only=True):
    prompt: Any = None
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None


def _ids(p: Any) -> bool:
    # booleans are ints to Python, never token ids
    return isinstance(p, list) and bool(p) and all(type(t) is int for t in p)


def prompts_of(raw: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(raw, str):
        return (raw,)
    if _ids(raw):
        return (tuple(raw),)
    if isinstance(raw, list) and raw:
        for i, p in enumerate(raw):
            if not (isinstance(p, str) or _ids(p)):
                raise InvalidRequest(
                    "each prompt must be a string or a non-empty list of token ids",
                    param=f"prompt[{i}]",
                )
        return tuple(p if isinstance(p, str) else tuple(p) for p in raw)
    raise InvalidRequest("prompt must be a string, strings or token ids", param="prompt")


def decode(raw: bytes) -> tuple[ApiRequest, CompletionBody]:
    """Everything that can be checked without the model; and the body, for the
    encoder."""
    body = decode_json(raw, CompletionBody)
    check_knobs(body)
    prompts = prompts_of(body.prompt)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    scoring = body.echo and body.logprobs is not None
    if scoring and body.stream:
        raise InvalidRequest(
            "echo with logprobs (the prompt's logprobs) is available without streaming",
            param="stream",
        )
    if body.suffix and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("suffix needs the prompt as text", param="suffix")
    return ApiRequest(
        model=body.model,
        dialect=Dialect.OPENAI,
        messages=(),
        completion=Completion(
            prompts=prompts, suffix=body.suffix or "", echo=body.echo, prompt_logprobs=scoring
        ),
        options=options_of(body),
        logit_bias=logit_bias_of(body),
        logprobs=body.logprobs,
        max_tokens=body.max_tokens,
        n=body.n,
        stream=body.stream,
        lora=lora_of(body),
        ignore_eos=body.ignore_eos,
        format=format_of(body),
    ), body


# -- response ----------------------------------------------------------------------------


class _Logprobs:
    """The legacy logprobs object: tokens, their logprobs, the top ones as a map, and
    each token's offset in the choice's text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self.offsets: list[int] = []

    def add(self, lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        """Append `lps`; they alone, as a stream chunk carries them."""
        part = _Logprobs(self.offset)
        for lp in lps:
            top = None if lp.logprob is None else {t.text: t.logprob for t in lp.top}
            for target in (self, part):
                target.tokens.append(lp.text)
                target.token_logprobs.append(lp.logprob)
                target.top.append(top)
                target.offsets.append(self.offset)
            self.offset += len(lp.text)
        return part.json()

    def then(self, other: _Logprobs) -> _Logprobs:
        for name in ("tokens", "token_logprobs", "top", "offsets"):
            getattr(self, name).extend(getattr(other, name))
        self.offset = other.offset
        return self

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        }


class CompletionEncoder:
    def __init__(self, req: ApiRequest, stamp: Stamp = STAMP, usage: bool = False) -> None:
        self.n = req.n
        self.runs = req.runs
        self.with_logprobs = req.logprobs is not None
        self.with_usage = usage
        self.head = {
            "id": stamp.ids("cmpl-"),
            "object": "text_completion",
            "created": int(stamp.now()),
            "model": req.model,
            "system_fingerprint": FINGERPRINT,
        }
        self.texts = [""] * self.runs
        self.logprobs = [_Logprobs(0) for _ in range(self.runs)]
        self.finished: dict[int, Finished] = {}

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return list(progress(position, loading_s))

    def _chunk(self, index: int, text: str, lps: Any = None, reason: str | None = None) -> Data:
        choice = {"text": text, "index": index, "logprobs": lps, "finish_reason": reason}
        frame: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.with_usage:
            frame["usage"] = None
        return Data(frame)

    def begin(self, begin: Begin) -> list[Frame]:
        """Each run's echo goes first."""
        out: list[Frame] = []
        for i, echo in enumerate(begin.echo):
            self.texts[i] = echo
            self.logprobs[i] = _Logprobs(len(echo))
            if echo:
                out.append(self._chunk(i, echo))
        return out

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        if isinstance(event, TextDelta):
            self.texts[index] += event.text
            lps = self.logprobs[index].add(event.logprobs) if self.with_logprobs else None
            return [self._chunk(index, event.text, lps)] if event.text or event.logprobs else []
        if isinstance(event, Finished):
            self.finished[index] = event
            if event.prompt_logprobs:  # the prompt's entries go in front
                head = _Logprobs(0)
                head.add(event.prompt_logprobs)
                self.logprobs[index] = head.then(self.logprobs[index])
            return [self._chunk(index, "", None, finish_reason(event))]
        return []  # completions parse nothing: no reasoning, no tool calls

    def _usage(self) -> dict[str, Any]:
        if len(self.finished) != self.runs:
            raise BarrelError("the generation ended without a result")
        usages: list[Usage] = [self.finished[i].usage for i in range(self.runs)]
        firsts = usages[:: self.n]  # one run of each prompt: the prompt counts once
        prompt = sum(u.prompt_tokens for u in firsts)
        completion = sum(u.completion_tokens for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.prompt_reused for u in firsts)},
        }

    def end(self) -> list[Frame]:
        usage = self._usage()
        if self.with_usage:
            return [Data({**self.head, "choices": [], "usage": usage}), DONE]
        return [DONE]

    def full(self) -> dict[str, Any]:
        usage = self._usage()
        choices = [
            {
                "text": self.texts[i],
                "index": i,
                "logprobs": self.logprobs[i].json() if self.with_logprobs else None,
                "finish_reason": finish_reason(self.finished[i]),
            }
            for i in range(self.runs)
        ]
        return {**self.head, "choices": choices, "usage": usage}

    def error(self, err: BarrelError) -> list[Frame]:
        return [error_frame(err)]


def encoder(req: ApiRequest, body: CompletionBody, stamp: Stamp = STAMP) -> CompletionEncoder:
    return CompletionEncoder(req, stamp, usage=include_usage(body))
