"""What every generation endpoint does around a model lease, whatever its dialect: the
request limits, the model's stored system prompt and messages, the compiled chat
template, and the pipeline's `prepare` off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from barrel.actors.lifecycle import Lease
from barrel.engine.model import LlamaModel
from barrel.errors import InvalidRequest
from barrel.http.keys import CONFIG
from barrel.pipeline.chat import ChatRequest, Prepared, make_template, prepare
from barrel.pipeline.templates import ChatTemplate
from barrel.pipeline.toolcalls import detect_family

# Compiled chat templates by (model, manifest digest).
TEMPLATES: web.AppKey[dict[tuple[str, str], ChatTemplate]] = web.AppKey("chat_templates")


def check_limits(request: web.Request, messages: list[Any], tools: list[Any]) -> None:
    limits = request.app[CONFIG].limits
    if len(messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are allowed")
    if len(tools) > limits.max_tools:
        raise InvalidRequest(f"at most {limits.max_tools} tools are allowed")


def with_model_messages(
    lease: Lease, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """The model's stored messages, then its SYSTEM (unless the request has a system
    message), then the request's; and how many were put in front."""
    spec = lease.spec
    head = list(spec.messages)
    if spec.system and not any(m["role"] == "system" for m in messages):
        head.append({"role": "system", "content": spec.system})
    return [*head, *messages], len(head)


async def template_of(request: web.Request, lease: Lease) -> ChatTemplate:
    cache: dict[tuple[str, str], ChatTemplate] = request.app[TEMPLATES]
    key = (lease.spec.name, lease.spec.digest)
    if key not in cache:
        model = lease.engine.model
        source = lease.spec.template or model.meta("tokenizer.chat_template") or ""
        bos = (
            model.piece(model.bos, special=True).decode(errors="replace") if model.bos >= 0 else ""
        )
        eos = (
            model.piece(model.eos, special=True).decode(errors="replace") if model.eos >= 0 else ""
        )
        cache[key] = await asyncio.to_thread(make_template, source, bos, eos)
    return cache[key]


# Below this much message text, without tools or a schema, rendering and tokenizing
# take well under a millisecond (0.2 ms for a one-line question on Qwen): less than the
# hop to a worker thread, which sits on the way to the first token.
INLINE_CHARS = 4000


def _small(req: ChatRequest) -> bool:
    if req.tools or req.response_format:
        return False
    return sum(len(str(m.get("content") or "")) for m in req.messages) < INLINE_CHARS


async def prepare_on(lease: Lease, req: ChatRequest, template: ChatTemplate) -> Prepared:
    """Render and tokenize (in a worker thread unless the request is small): bad input
    fails here, before the engine sees it."""
    model = lease.engine.model
    args = (req, template, model.tokenize, detect_family(template.source), model.control_tokens)
    if _small(req):
        return prepare(*args)
    return await asyncio.to_thread(prepare, *args)


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def fim_prompt(model: LlamaModel, prefix: str, suffix: str) -> list[int]:
    """Fill-in-the-middle: prefix and suffix around the model's FIM tokens, the answer
    being the middle. A model without those tokens cannot do it (400)."""
    pre, suf, mid = (model.token_id(t) for t in FIM_TOKENS)
    if pre is None or suf is None or mid is None:
        raise InvalidRequest(
            "this model does not support insert (fill-in-the-middle)", param="suffix"
        )
    return [
        pre,
        *model.tokenize(prefix, add_special=False),
        suf,
        *model.tokenize(suffix, add_special=False),
        mid,
    ]
