"""OpenAI's legacy POST /v1/completions, and llama-server's POST /tokenize and /detokenize.

Completions take the prompt as it is, without a chat template: a string, strings, token
ids or lists of token ids; each prompt gets `n` choices (index = prompt * n + choice).
`suffix` asks for fill-in-the-middle on models with FIM tokens. `echo` puts the prompt in
front of the text; with `logprobs` too (scoring a text, as evaluation harnesses do with
max_tokens 0) the prompt is computed again and each of its tokens gets its logprob (the
first one null), without streaming.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from aiohttp import web

from barrel.actors.model_session import ModelSession
from barrel.config import LimitsConfig
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import new_id
from barrel.http.codecs.openai_common import Knobs, check_knobs, include_usage, lora_of
from barrel.http.generate import merged, scope_of
from barrel.http.keys import CONFIG
from barrel.http.openai_common import decode, leased, sampling_for, stream_failed, unqueued
from barrel.http.sse import SseWriter
from barrel.pipeline.generate import lora_scales
from barrel.pipeline.types import Delta, Done, GenerationRequest, TokenLogprob, Usage

routes = web.RouteTableDef()

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGPROBS = 20


class CompletionBody(Knobs, kw_only=True):
    prompt: Any = None
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None


def _prompts(raw: Any) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw):
        return [raw]
    if isinstance(raw, list) and raw:
        for i, p in enumerate(raw):
            ids = isinstance(p, list) and p and all(isinstance(t, int) for t in p)
            if not (isinstance(p, str) or ids):
                raise InvalidRequest(
                    "each prompt must be a string or a non-empty list of token ids",
                    param=f"prompt[{i}]",
                )
        return list(raw)
    raise InvalidRequest("prompt must be a string, strings or token ids", param="prompt")


def _check(body: CompletionBody, limits: LimitsConfig) -> list[str | list[int]]:
    check_knobs(body)
    prompts = _prompts(body.prompt)
    if len(prompts) * body.n > limits.max_sequences:
        raise InvalidRequest(
            f"{len(prompts)} prompts x n={body.n} is more than the {limits.max_sequences} "
            "sequences one request may run",
            param="prompt",
        )
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stops) > limits.max_stop:
        raise InvalidRequest(f"at most {limits.max_stop} stop strings are allowed", param="stop")
    if any(len(s) > limits.max_stop_length for s in stops):
        raise InvalidRequest(
            f"a stop string may have at most {limits.max_stop_length} characters", param="stop"
        )
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs")
    if body.echo and body.logprobs is not None and body.stream:
        raise InvalidRequest(
            "echo with logprobs (the prompt's logprobs) is available without streaming",
            param="stream",
        )
    if body.suffix and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("suffix needs the prompt as text", param="suffix")
    return prompts


def _tokens(
    session: ModelSession, prompts: list[str | list[int]], suffix: str | None
) -> list[list[int]]:
    out = []
    for p in prompts:
        if isinstance(p, list):
            session.check_tokens(p, "prompt")
            out.append(list(p))
        elif suffix:
            out.append(session.fim_prompt(p, suffix))
        else:
            out.append(session.tokenize(p, add_special=True))
    return out


async def _generate(
    session: ModelSession, req: GenerationRequest
) -> AsyncGenerator[Delta | Done, None]:
    async with session.submit(req) as stream:
        async for event in stream:
            yield event
            if isinstance(event, Done):
                return


class _Logprobs:
    """The legacy logprobs object: tokens, their logprobs, the top ones as a map, and
    each token's offset in the choice's text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self.offsets: list[int] = []

    def first(self, text: str) -> None:
        """The prompt's first token: nothing before it, so no logprob."""
        self.tokens.append(text)
        self.token_logprobs.append(None)
        self.top.append(None)
        self.offsets.append(self.offset)
        self.offset += len(text)

    def then(self, other: _Logprobs) -> _Logprobs:
        for name in ("tokens", "token_logprobs", "top", "offsets"):
            getattr(self, name).extend(getattr(other, name))
        self.offset = other.offset
        return self

    def add(self, lps: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        part = _Logprobs(self.offset)
        for lp in lps:
            for target in (self, part):
                target.tokens.append(lp.text)
                target.token_logprobs.append(lp.logprob)
                target.top.append({t.text: t.logprob for t in lp.top})
                target.offsets.append(self.offset)
            self.offset += len(lp.text)
        return part.json()

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        }


def _usage(prompts: list[list[int]], usages: dict[int, Usage], n: int) -> dict[str, Any]:
    completion = sum(u.completion_tokens for u in usages.values())
    prompt = sum(len(p) for p in prompts)
    cached = sum(usages[i * n].prompt_reused for i in range(len(prompts)) if i * n in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await decode(request, CompletionBody)
    texts = _check(body, request.app[CONFIG].limits)
    sse = SseWriter(request) if body.stream else None
    try:
        async with leased(request, body.model, sse, sequences=len(texts) * body.n) as session:
            prompts = await asyncio.to_thread(_tokens, session, texts, body.suffix)
            sampling, max_tokens, stop = sampling_for(body, session, body.logprobs)
            if body.max_tokens is None and session.spec.parameters.get("num_predict") is None:
                max_tokens = DEFAULT_MAX_TOKENS
            scoring = body.echo and body.logprobs is not None
            lora = lora_scales(lora_of(body), session.adapters)
            reqs = [
                GenerationRequest(
                    p,
                    sampling,
                    max_tokens=max_tokens,
                    stop=stop,
                    prompt_logprobs=scoring,
                    scope=scope_of(request),
                    lora=lora,
                    ignore_eos=body.ignore_eos,
                )
                for p in prompts
                for _ in range(body.n)
            ]
            echoes = [
                _echo(session, t, p, scoring) if body.echo else ""
                for t, p in zip(texts, prompts, strict=True)
                for _ in range(body.n)
            ]
            out = await _complete(sse, body, session, reqs, echoes, prompts)
            if out is not None:
                return web.json_response(out)
    except ConnectionError:
        raise
    except Exception as err:  # noqa: BLE001 - a stream that began ends with an error frame
        return await stream_failed(sse, err)
    assert sse is not None
    return await sse.close()


def _echo(session: ModelSession, text: str | list[int], prompt: list[int], scoring: bool) -> str:
    """The prompt as the answer's head: as sent, or, when its tokens are scored, the
    tokens' pieces (so that the offsets of their logprobs point into it)."""
    if scoring:
        return "".join(session.piece(t) for t in prompt)
    return text if isinstance(text, str) else session.detokenize(prompt)


async def _complete(
    sse: SseWriter | None,
    body: CompletionBody,
    session: ModelSession,
    reqs: list[GenerationRequest],
    echoes: list[str],
    prompts: list[list[int]],
) -> dict[str, Any] | None:
    head = {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    with_usage = sse is not None and include_usage(body)
    texts = list(echoes)
    logprobs = [_Logprobs(len(e)) for e in echoes]
    finish: dict[int, str] = {}
    usages: dict[int, Usage] = {}

    async def send(index: int, text: str, lps: Any = None, reason: str | None = None) -> None:
        if sse is None:
            return
        choice = {"text": text, "index": index, "logprobs": lps, "finish_reason": reason}
        frame = {**head, "choices": [choice]}
        if with_usage:
            frame["usage"] = None
        await sse.send(frame)

    for i, echo in enumerate(echoes):
        if echo:
            await send(i, echo)
    live = [i for i, r in enumerate(reqs) if r.max_tokens != 0 or r.prompt_logprobs]
    for i in set(range(len(reqs))) - set(live):
        finish[i] = "length"
        await send(i, "", None, "length")
    streams = [_generate(session, reqs[i]) for i in live]
    async for k, event in merged(streams):
        i = live[k]
        if isinstance(event, Delta):
            texts[i] += event.text
            lps = logprobs[i].add(event.logprobs) if body.logprobs is not None else None
            if event.text or event.logprobs:
                await send(i, event.text, lps)
        else:
            reason = event.finish_reason.value
            finish[i] = "stop" if reason == "cancelled" else reason
            usages[i] = event.usage
            if reqs[i].prompt_logprobs:  # the prompt's entries go in front
                head_lps = _Logprobs(0)
                head_lps.first(session.piece(reqs[i].prompt[0]))
                head_lps.add(event.prompt_logprobs)
                logprobs[i] = head_lps.then(logprobs[i])
            await send(i, "", None, finish[i])
    if len(finish) != len(reqs):
        raise BarrelError("the generation ended without a result")
    usage = _usage(prompts, usages, body.n)
    if sse is not None:
        if with_usage:
            await sse.send({**head, "choices": [], "usage": usage})
        await sse.done()
        return None
    choices = [
        {
            "text": texts[i],
            "index": i,
            "logprobs": logprobs[i].json() if body.logprobs is not None else None,
            "finish_reason": finish[i],
        }
        for i in range(len(reqs))
    ]
    return {**head, "choices": choices, "usage": usage}


# -- tokenizer ----------------------------------------------------------------------------


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str = ""
    content: str = ""
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeBody(msgspec.Struct, kw_only=True):
    model: str = ""
    tokens: list[int] = msgspec.field(default_factory=list)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    body = await decode(request, TokenizeBody)
    async with unqueued(request, body.model) as session:
        ids = await asyncio.to_thread(session.tokenize, body.content, add_special=body.add_special)
        if not body.with_pieces:
            return web.json_response({"tokens": ids})
        pieces = [{"id": t, "piece": session.piece(t, special=True)} for t in ids]
    return web.json_response({"tokens": pieces})


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    body = await decode(request, DetokenizeBody)
    async with unqueued(request, body.model) as session:
        session.check_tokens(body.tokens, "tokens")
        text = await asyncio.to_thread(session.detokenize, body.tokens)
    return web.json_response({"content": text})
