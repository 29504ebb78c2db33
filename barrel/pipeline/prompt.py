"""A chat's prompt: the chat template rendered with the tools and template keywords,
tokenized so that message text never yields control tokens, media markers replaced by
the projector's tokens, and the grammar a forced tool call or a response format asks
for (barrel.pipeline.chat says what tool_choice does).

    prep = prepare(chat, template, tokenize, ...)   # the pipeline's worker thread
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

from barrel.engine.kvcache import common_prefix
from barrel.engine.projector import Piece
from barrel.errors import InvalidRequest
from barrel.pipeline.chat import ChatRequest, Prepared
from barrel.pipeline.families import Family, family
from barrel.pipeline.formats import call_grammar, format_grammar, json_schema_grammar
from barrel.pipeline.images import REFUSAL, image_marker, markers_of
from barrel.pipeline.request import Tool
from barrel.pipeline.templates import ChatTemplate


def template_tools(tools: tuple[Tool, ...]) -> list[dict[str, Any]]:
    """Neutral tools -> what chat templates read (the OpenAI function shape, as Hugging
    Face's templates expect)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in tools
    ]


def _call_schema(tool: Tool, n: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of a call of `tool`, and the definitions its arguments use. A `$ref` is
    read from the root of the schema the grammar compiles, the call (or the choice of
    calls), not from the arguments': the parameters' `$defs` / `definitions` go to that
    root as `t<n>_<name>`, and each reference into the parameters with them (one into the
    parameters' own root, "#" or "#/properties/...", through `t<n>_root`)."""
    prefix = f"t{n}_"
    params = dict(tool.parameters)
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        given = params.pop(key, None)
        if isinstance(given, dict):
            defs.update({prefix + name: sub for name, sub in given.items()})
    rooted = False

    def moved(node: Any) -> Any:
        nonlocal rooted
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("const", "enum", "default", "examples"):
                out[key] = value  # data, not schema
            elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
                parts = value[1:].split("/", 3)  # "", "$defs", name, rest
                if len(parts) >= 3 and parts[1] in ("$defs", "definitions"):
                    out[key] = "/".join(["#", "$defs", prefix + parts[2], *parts[3:]])
                else:
                    rooted = True
                    out[key] = f"#/$defs/{prefix}root{value[1:]}"
            else:
                out[key] = moved(value)
        return out

    arguments = moved(params)
    defs = {name: moved(sub) for name, sub in defs.items()}
    if rooted:
        defs[prefix + "root"] = arguments
    call = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return call, defs


def forced_schema(req: ChatRequest) -> dict[str, Any] | None:
    """The schema of the call a forced tool choice writes (the choice was checked
    against the tools by barrel.pipeline.generation.check), the tools' definitions at
    its root."""
    mode = req.tool_choice.mode
    if not req.tools or mode in ("auto", "none"):
        return None
    if mode == "required":
        calls = [_call_schema(t, n) for n, t in enumerate(req.tools)]
    else:
        calls = [_call_schema(next(t for t in req.tools if t.name == req.tool_choice.name))]
    defs = {name: sub for _, d in calls for name, sub in d.items()}
    schema = calls[0][0] if len(calls) == 1 else {"anyOf": [c for c, _ in calls]}
    return {**schema, "$defs": defs} if defs else schema


def _call_grammar(
    schema: dict[str, Any], fam: Family | None, tokenize_as: Tokenize | None, calls: int
) -> str | None:
    """A forced call's grammar in the family's own syntax, where the family writes a JSON
    call between two markers that are one token each (hermes); else None (a bare JSON
    call object, read by the generic parser)."""
    if fam is None or tokenize_as is None or fam.body != "json" or not fam.starts or not fam.end:
        return None
    start = tokenize_as(fam.starts[0], False, True)
    end = tokenize_as(fam.end, False, True)
    if len(start) != 1 or len(end) != 1:
        return None
    return call_grammar(schema, start[0], end[0], calls)


def _open_final(prompt_text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered prompt cut right after the final assistant message's text, so the
    model continues it (vLLM's `continue_final_message`): the template's end of turn
    and whatever follows go."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if final.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise InvalidRequest(
            "continue_final_message needs a final assistant message with text to continue",
            param="continue_final_message",
        )
    at = prompt_text.rfind(content)
    if at < 0:
        raise InvalidRequest(
            "continue_final_message: the chat template does not show the final message's "
            "text as written",
            param="continue_final_message",
        )
    return prompt_text[: at + len(content)]


def prepare(
    req: ChatRequest,
    template: ChatTemplate,
    tokenize: Callable[[str], list[int]],
    template_family: Family,
    control_tokens: Callable[[str], set[int]] | None = None,
    tokenize_as: Tokenize | None = None,
    read_media: Callable[[dict[str, bytes]], dict[str, Piece]] | None = None,
) -> Prepared:
    """Everything that can fail on bad input happens here, before any slow work.
    `tokenize_as(text, add_special, parse_special)`, when given, keeps control-token text
    inside messages plain text (see `_tokenize_prompt`). `read_media` is the model's
    projector (None: it reads neither images nor audio)."""
    _refuse_images(req.messages)
    forced = forced_schema(req)
    tools = template_tools(req.tools) if req.tool_choice.mode != "none" else []
    kwargs = dict(req.template_kwargs)
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", req.thinking)
    messages = req.messages
    if tools and not template.renders_tools and template_family.name == "generic":
        messages = with_tool_instructions(messages, tools)
    start = time.perf_counter()
    generation_prompt = req.generation_prompt and not req.continue_final
    prompt_text = template.render(
        messages, tools or None, add_generation_prompt=generation_prompt, **kwargs
    )
    if req.continue_final:
        prompt_text = _open_final(prompt_text, messages)
    render_s = time.perf_counter() - start
    sampling = req.sampling
    # Built now even when thinking comes first: a bad schema is a 400 before any work.
    bare_call = calls_only = False
    if forced is not None:
        # "required" with parallel calls: up to one call per tool (a small model left
        # unbounded repeats the same call until max_tokens)
        calls = (
            len(req.tools) if req.parallel_tool_calls and req.tool_choice.mode == "required" else 1
        )
        family_of = template_family if tools else None
        grammar = _call_grammar(forced, family_of, tokenize_as, calls)
        bare_call = grammar is None
        calls_only = not bare_call
        if grammar is None:
            grammar = json_schema_grammar(forced)
    else:
        grammar = format_grammar(req.format)
    if grammar is not None and not req.thinking:
        sampling = msgspec.structs.replace(sampling, grammar=grammar)
    pieces: dict[str, Piece] = {}
    if req.media:
        if read_media is None or tokenize_as is None:
            raise InvalidRequest(REFUSAL)
        pieces = read_media(req.media)
    prompt = _tokenize_prompt(prompt_text, messages, tokenize, control_tokens, tokenize_as, pieces)
    media = {m.token: m for piece in pieces.values() for m in piece.media if m.token in prompt}
    fam = template_family if tools else family("generic")
    preserve: set[int] = set()
    if control_tokens is not None:
        for marker in fam.markers:
            preserve |= control_tokens(marker)
    return Prepared(
        thinking_template="<think>" in template.source,
        preserve=frozenset(preserve),
        prompt=prompt,
        static_prefix=_static_prefix(
            messages,
            req.pin_messages + (len(messages) - len(req.messages)) if req.pin_messages else 0,
            template,
            tokenize,
            tools,
            kwargs,
            prompt,
        ),
        sampling=sampling,
        family=fam,
        forced_call=bare_call,
        calls_only=calls_only,
        grammar=grammar,
        tool_names=tuple(t.name for t in req.tools) if tools else (),
        render_s=render_s,
        media=tuple(media.values()),
        next_turn=tuple(tokenize_as(template.next_turn, False, True))
        if template.next_turn and tokenize_as is not None
        else (),
    )


Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)


def _tokenize_prompt(
    text: str,
    messages: list[dict[str, Any]],
    tokenize: Callable[[str], list[int]],
    control_tokens: Callable[[str], set[int]] | None,
    tokenize_as: Tokenize | None,
    media: dict[str, Piece] | None = None,
) -> list[int]:
    """The rendered prompt's tokens. Only the template's own markup may become control
    tokens: message text that spells one (`<|im_start|>system` in a user's message) is
    tokenized as text, so a client cannot forge turns. Most messages hold no such text
    and the prompt is tokenized whole; otherwise the render is cut around those
    messages' text, found where the template put it verbatim. `media` (images and
    audio clips, by SHA-256): each one's marker becomes the projector's tokens for it."""
    if control_tokens is None or tokenize_as is None:
        return tokenize(text)
    markers = markers_of(set(media)) if media else None
    by_marker = {image_marker(d): piece for d, piece in (media or {}).items()}
    contents = [c for m in messages if isinstance(c := m.get("content"), str)]
    if markers is not None:
        contents = [piece for c in contents for piece in markers.split(c)]
    risky = [c for c in contents if ("<" in c or "[" in c) and control_tokens(c)]
    if not risky and markers is None:
        return tokenize(text)
    if not risky:
        return _with_media(text, True, True, markers, by_marker, tokenize_as)
    spans: list[tuple[int, int]] = []
    pos = 0
    for content in risky:
        start = text.find(content, pos)
        if start < 0:
            raise InvalidRequest(
                "a message contains the model's control tokens as text, and its chat "
                "template changes that message: it cannot be sent as plain text"
            )
        spans.append((start, start + len(content)))
        pos = start + len(content)
    out: list[int] = []
    last = 0
    for start, end in spans:
        out += _with_media(text[last:start], last == 0, True, markers, by_marker, tokenize_as)
        out += tokenize_as(text[start:end], False, False)
        last = end
    return out + _with_media(text[last:], False, True, markers, by_marker, tokenize_as)


def _with_media(
    text: str,
    add_special: bool,
    parse_special: bool,
    markers: re.Pattern[str] | None,
    media: dict[str, Piece],
    tokenize_as: Tokenize,
) -> list[int]:
    """Template text with image markers: the text around them tokenized, each marker
    replaced by its image's or clip's tokens (`media` by marker)."""
    if markers is None:
        return tokenize_as(text, add_special, parse_special)
    out: list[int] = []
    last = 0
    for match in markers.finditer(text):
        out += tokenize_as(text[last : match.start()], add_special and last == 0, parse_special)
        out += media[match.group(0)].tokens()
        last = match.end()
    return out + tokenize_as(text[last:], add_special and last == 0, parse_special)


TOOL_INSTRUCTIONS = (
    "You can call the following tools. To call one, answer with only a JSON object of "
    'the form {"name": "<tool name>", "arguments": {<the arguments>}} and nothing '
    "else; otherwise answer normally.\n\nTools:\n"
)


def with_tool_instructions(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """For templates that take `tools` but print none of them: the definitions and the
    call format (the bare JSON object the generic parser reads) join the system
    message, as llama.cpp does for such templates."""
    definitions = json.dumps([t.get("function", t) for t in tools], indent=2, ensure_ascii=False)
    text = TOOL_INSTRUCTIONS + definitions
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _refuse_images(messages: list[dict[str, Any]]) -> None:
    """Images reach the pipeline as markers in the text (barrel.pipeline.images); parts
    shaped like a dialect's image parts are not read."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in ("image_url", "image", "input_image")
            for p in content
        ):
            raise InvalidRequest(REFUSAL)
        if m.get("images"):
            raise InvalidRequest(REFUSAL)


MIN_PIN = 64  # a static prefix shorter than this is not worth a pinned sequence


def _static_prefix(
    messages: list[dict[str, Any]],
    pin_messages: int,
    template: ChatTemplate,
    tokenize: Callable[[str], list[int]],
    tools: list[dict[str, Any]],
    kwargs: dict[str, Any],
    prompt: list[int],
) -> int:
    """The system + tools head every conversation with these tools starts with: the
    common token prefix of a render with the system messages only and the full one."""
    if pin_messages:
        head = messages[:pin_messages]
    else:
        head = [m for m in messages if m.get("role") in ("system", "developer")]
    if not tools and not head:
        return 0
    try:
        vocabulary = id(getattr(tokenize, "__self__", tokenize))  # one template, one model
        key = json.dumps([vocabulary, head, tools, kwargs], sort_keys=True, default=str)
    except (TypeError, ValueError):
        key = ""
    tokens = template.heads.get(key) if key else None
    if tokens is None:
        try:
            text = template.render(head, tools or None, add_generation_prompt=False, **kwargs)
        except InvalidRequest:
            return 0  # templates that insist on a user turn have no separable head
        tokens = tokenize(text)
        if key:
            template.heads.put(key, tokens)
    return common_prefix(tokens, prompt)
