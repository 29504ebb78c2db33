"""Ollama's generation endpoints: /api/chat, /api/generate, /api/embed, /api/embeddings.

Requests decode into the chat pipeline's neutral `ChatRequest`; its events encode as
Ollama's NDJSON objects (or one object when `stream` is false). Timings are nanoseconds,
as Ollama reports them. Keep-alive, queueing and loading go through the Lifecycle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from barrel.actors.lifecycle import keep_alive_seconds
from barrel.engine.model import LlamaModel
from barrel.engine.types import SamplingParams, TokenLogprob
from barrel.errors import BarrelError, InvalidRequest
from barrel.http.keys import CONFIG, LIFECYCLE, METRICS
from barrel.http.leases import (
    check_limits,
    fim_prompt,
    prepare_on,
    template_of,
    with_model_messages,
)
from barrel.pipeline.chat import (
    ChatRequest,
    Finished,
    Prepared,
    ReasoningDelta,
    TextDelta,
    ToolCallEvent,
    run,
)
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import ChatTemplate

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()

# Ollama's defaults, under the model's stored PARAMETERs, under the request's options.
DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
}


class _Body(msgspec.Struct, kw_only=True):
    model: str = ""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    keep_alive: int | float | str | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = 0


class ChatBody(_Body, kw_only=True):
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)


class GenerateBody(_Body, kw_only=True):
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] = msgspec.field(default_factory=list)
    context: list[int] = msgspec.field(default_factory=list)


class EmbedBody(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: int | float | str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class LegacyEmbedBody(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str = ""
    keep_alive: int | float | str | None = None


async def _decode(request: web.Request, kind: type[Any]) -> Any:
    raw = await request.read()
    try:
        body = msgspec.json.decode(raw or b"{}", type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    if not getattr(body, "model", ""):
        raise InvalidRequest("model is required")
    return body


def _keep_alive(request: web.Request, value: Any) -> float:
    try:
        return keep_alive_seconds(value, request.app[CONFIG].models.default_keep_alive)
    except ValueError as exc:
        raise InvalidRequest(f"keep_alive: {exc}") from None


def sampling_from(
    options: dict[str, Any], params: dict[str, Any]
) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    o = {**DEFAULTS, **params, **options}
    try:
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
            seed=int(o["seed"]) if o.get("seed") is not None and int(o["seed"]) >= 0 else None,
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


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"schema": fmt}}
    raise InvalidRequest(f'format must be "json" or a JSON schema, not {fmt!r}')


def _think(value: bool | str | None) -> tuple[bool | None, dict[str, Any]]:
    if value is None:
        return None, {}
    if isinstance(value, bool):
        return value, {}
    if value in ("low", "medium", "high"):
        return True, {"reasoning_effort": value}
    raise InvalidRequest('think must be true, false, "low", "medium" or "high"')


def _messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama messages -> the pipeline's (OpenAI-shaped) messages."""
    out = []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest("each message needs a role: system, user, assistant or tool")
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("images"):
            msg["images"] = m["images"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "id": f"call{i:05d}a",
                    "type": "function",
                    "function": {
                        "name": (c.get("function") or {}).get("name", ""),
                        "arguments": (c.get("function") or {}).get("arguments", {}),
                    },
                }
                for i, c in enumerate(m["tool_calls"])
            ]
        if m["role"] == "tool" and m.get("tool_name"):
            msg["name"] = m["tool_name"]
        out.append(msg)
    return out


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e9):09d}Z"


async def _lifecycle_only(
    request: web.Request, model: str, keep_alive: float
) -> web.Response | None:
    """Ollama's preload (no prompt / no messages) and unload (keep_alive 0) answers."""
    lifecycle = request.app[LIFECYCLE]
    start = time.perf_counter()
    if keep_alive == 0:
        await lifecycle.unload(model)
        reason = "unload"
    else:
        await lifecycle.preload(model, keep_alive)
        reason = "load"
    return web.json_response(
        {
            "model": model,
            "created_at": _now(),
            "response": "",
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": reason,
            "total_duration": _ns(time.perf_counter() - start),
            "load_duration": _ns(time.perf_counter() - start),
        }
    )


@routes.post("/api/chat")
async def chat(request: web.Request) -> web.StreamResponse:
    body: ChatBody = await _decode(request, ChatBody)
    check_limits(request, body.messages, body.tools)
    keep_alive = _keep_alive(request, body.keep_alive)
    if not body.messages:
        response = await _lifecycle_only(request, body.model, keep_alive)
        assert response is not None
        return response
    messages = _messages(body.messages)
    return await _generate(request, body, messages, body.tools, keep_alive, chat=True)


@routes.post("/api/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    body: GenerateBody = await _decode(request, GenerateBody)
    keep_alive = _keep_alive(request, body.keep_alive)
    if body.images:
        raise InvalidRequest("this model reads text only; images are not supported")
    if not body.prompt and not body.suffix:
        response = await _lifecycle_only(request, body.model, keep_alive)
        assert response is not None
        return response
    messages = []
    if body.system is not None:
        messages.append({"role": "system", "content": body.system})
    messages.append({"role": "user", "content": body.prompt})
    return await _generate(request, body, messages, [], keep_alive, chat=False)


async def _generate(
    request: web.Request,
    body: ChatBody | GenerateBody,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    keep_alive: float,
    *,
    chat: bool,
) -> web.StreamResponse:
    started = time.perf_counter()
    lifecycle = request.app[LIFECYCLE]
    thinking, kwargs = _think(body.think)
    response_format = _format(body.format)
    lease = await lifecycle.acquire(body.model, keep_alive)
    load_s = time.perf_counter() - started
    resp: web.StreamResponse | None = None
    try:
        spec = lease.spec
        sampling, max_tokens, stop = sampling_from(body.options, spec.parameters)
        if body.logprobs:
            if not 0 <= body.top_logprobs <= 20:
                raise InvalidRequest("top_logprobs must be between 0 and 20")
            sampling = msgspec.structs.replace(sampling, logprobs=body.top_logprobs)
        messages, _ = with_model_messages(lease, messages)
        req = ChatRequest(
            messages,
            tools=tools,
            response_format=response_format,
            sampling=sampling,
            max_tokens=max_tokens,
            stop=stop,
            thinking=thinking,
            session=derive_session(spec.name, messages, request.headers.get("x-conversation-id")),
            template_kwargs=kwargs,
        )
        model = lease.engine.model
        prompt_override = _raw_prompt(body, model) if isinstance(body, GenerateBody) else None
        if prompt_override is not None:
            template = ChatTemplate("{{ messages[-1].content }}")
        else:
            template = await template_of(request, lease)
        prep = await prepare_on(lease, req, template)
        if prompt_override is not None:
            prep = _with_prompt(prep, prompt_override)
        elif isinstance(body, GenerateBody) and body.context:
            prep = _with_prompt(prep, [*body.context, *prep.prompt])
        events = run(lease.engine, req, prep, request.app[METRICS].pipeline_timings)
        name = body.model
        if body.stream:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            final = await _stream(resp, events, name, chat)
        else:
            final = await _collect(events, name, chat)
        final.update(_timings(final.pop("_finished"), started, load_s, prep.prompt, chat))
        if not chat:
            final["context"] = [*prep.prompt, *final.pop("_tokens", [])]
        else:
            final.pop("_tokens", None)
        if resp is not None:
            await resp.write(_line(final))
            await resp.write_eof()
            return resp
        return web.json_response(final)
    except BarrelError as err:
        if resp is None:
            raise
        await resp.write(_line({"error": err.message}))
        await resp.write_eof()
        return resp
    finally:
        await lifecycle.release(lease, keep_alive)


def _with_prompt(prep: Prepared, prompt: list[int]) -> Prepared:
    return dataclasses.replace(prep, prompt=prompt, static_prefix=0)


def _raw_prompt(body: GenerateBody, model: LlamaModel) -> list[int] | None:
    """raw prompts skip the template; a suffix asks for fill-in-the-middle."""
    if body.suffix:
        return fim_prompt(model, body.prompt, body.suffix)
    if body.raw:
        return model.tokenize(body.prompt, add_special=True)
    if body.template:
        raise InvalidRequest("a per-request template is not supported; use raw or a Modelfile")
    return None


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _logprobs(lps: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    return [
        {
            "token": lp.text,
            "logprob": lp.logprob,
            "top_logprobs": [{"token": t.text, "logprob": t.logprob} for t in lp.top],
        }
        for lp in lps
    ]


def _chunk(
    name: str, chat: bool, content: str = "", thinking: str = "", calls: list[Any] | None = None
) -> dict[str, Any]:
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"model": name, "created_at": _now(), "message": message, "done": False}
    out: dict[str, Any] = {"model": name, "created_at": _now(), "response": content, "done": False}
    if thinking:
        out["thinking"] = thinking
    return out


def _call(event: ToolCallEvent) -> dict[str, Any]:
    return {"function": {"name": event.name, "arguments": json.loads(event.arguments)}}


async def _stream(
    resp: web.StreamResponse, events: AsyncIterator[Any], name: str, chat: bool
) -> dict[str, Any]:
    async for event in events:
        if isinstance(event, TextDelta) and (event.text or event.logprobs):
            chunk = _chunk(name, chat, content=event.text)
            if event.logprobs:
                chunk["logprobs"] = _logprobs(event.logprobs)
            await resp.write(_line(chunk))
        elif isinstance(event, ReasoningDelta) and event.text:
            await resp.write(_line(_chunk(name, chat, thinking=event.text)))
        elif isinstance(event, ToolCallEvent):
            await resp.write(_line(_chunk(name, chat, calls=[_call(event)])))
        elif isinstance(event, Finished):
            final = _chunk(name, chat)
            final["done"] = True
            final["done_reason"] = "stop" if event.reason == "tool_calls" else event.reason
            final["_finished"] = event
            return final
    raise BarrelError("the generation ended without a result")


async def _collect(events: AsyncIterator[Any], name: str, chat: bool) -> dict[str, Any]:
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    lps: list[TokenLogprob] = []
    async for event in events:
        if isinstance(event, TextDelta):
            text.append(event.text)
            lps.extend(event.logprobs)
        elif isinstance(event, ReasoningDelta):
            thinking.append(event.text)
        elif isinstance(event, ToolCallEvent):
            calls.append(_call(event))
        elif isinstance(event, Finished):
            final = _chunk(name, chat, "".join(text), "".join(thinking), calls)
            lps.extend(event.logprobs)
            if lps:
                final["logprobs"] = _logprobs(tuple(lps))
            final["done"] = True
            final["done_reason"] = "stop" if event.reason == "tool_calls" else event.reason
            final["_finished"] = event
            return final
    raise BarrelError("the generation ended without a result")


def _timings(
    fin: Finished, started: float, load_s: float, prompt: list[int], chat: bool
) -> dict[str, Any]:
    return {
        "total_duration": _ns(time.perf_counter() - started),
        "load_duration": _ns(load_s),
        "prompt_eval_count": len(prompt),
        "prompt_eval_duration": _ns(fin.prefill_s),
        "eval_count": fin.usage.completion_tokens,
        "eval_duration": _ns(fin.decode_s),
    }


# -- embeddings ---------------------------------------------------------------------


def shorten_embedding(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, normalised again (Matryoshka-style shortening)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    if dimensions < 1:
        raise InvalidRequest("dimensions must be positive")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut)) or 1.0
    return [x / norm for x in cut]


@routes.post("/api/embed")
async def embed(request: web.Request) -> web.Response:
    body: EmbedBody = await _decode(request, EmbedBody)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    cap = request.app[CONFIG].limits.max_embedding_inputs
    if not inputs or len(inputs) > cap:
        raise InvalidRequest(f"input must hold 1 to {cap} items")
    keep_alive = _keep_alive(request, body.keep_alive)
    started = time.perf_counter()
    lifecycle = request.app[LIFECYCLE]
    lease = await lifecycle.embedder(body.model, keep_alive)
    load_s = time.perf_counter() - started
    try:
        model = lease.engine.model
        tokens = await asyncio.to_thread(lambda: [model.tokenize(t) for t in inputs])
        vectors = await lease.engine.embed(tokens, truncate=body.truncate)
    finally:
        await lifecycle.release(lease, keep_alive)
    return web.json_response(
        {
            "model": body.model,
            "embeddings": [shorten_embedding(v, body.dimensions) for v in vectors],
            "total_duration": _ns(time.perf_counter() - started),
            "load_duration": _ns(load_s),
            "prompt_eval_count": sum(len(t) for t in tokens),
        }
    )


@routes.post("/api/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body: LegacyEmbedBody = await _decode(request, LegacyEmbedBody)
    keep_alive = _keep_alive(request, body.keep_alive)
    lifecycle = request.app[LIFECYCLE]
    lease = await lifecycle.embedder(body.model, keep_alive)
    try:
        tokens = lease.engine.model.tokenize(body.prompt)
        (vector,) = await lease.engine.embed([tokens], truncate=True, normalize=False)
    finally:
        await lifecycle.release(lease, keep_alive)
    return web.json_response({"embedding": vector})
