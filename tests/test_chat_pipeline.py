"""The chat pipeline end to end on real llama.cpp: forced tool calls, structured output
with reasoning, and the real model choosing a tool."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from barrel.config import LimitsConfig
from barrel.engine.context import EngineOptions
from barrel.engine.engine import Engine
from barrel.engine.model import LlamaModel
from barrel.engine.types import EngineRequest, SamplingParams
from barrel.errors import InvalidRequest
from barrel.pipeline import generation
from barrel.pipeline.answer import run
from barrel.pipeline.chat import ChatRequest
from barrel.pipeline.events import Finished, ReasoningDelta, TextDelta, ToolCallEvent
from barrel.pipeline.families import detect_family
from barrel.pipeline.prompt import prepare, template_tools
from barrel.pipeline.request import ApiRequest, Dialect, Format, Tool, ToolChoice, text
from barrel.pipeline.templates import ChatTemplate

WEATHER = Tool(
    "get_weather",
    "Get the current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = Tool(
    "get_time",
    parameters={
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 10}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)


class Setup:
    def __init__(self, model: LlamaModel, engine: Engine) -> None:
        self.model = model
        self.engine = engine
        source = model.meta("tokenizer.chat_template") or ""
        self.template = ChatTemplate(source)
        self.family = detect_family(source)

    async def chat(self, req: ChatRequest) -> list[Any]:
        prep = prepare(
            req,
            self.template,
            lambda t: self.model.tokenize(t),
            self.family,
            self.model.control_tokens,
        )
        return [event async for event in run(self.engine, req, prep)]


async def _setup(path: Path, n_ctx: int = 2048) -> AsyncIterator[Setup]:
    model = LlamaModel.load(path)
    engine = Engine(model, EngineOptions(n_ctx=n_ctx, n_seq_max=4)).start()
    yield Setup(model, engine)
    await asyncio.to_thread(engine.stop)
    model.free()


@pytest.fixture
async def tiny(tiny_path: Path) -> AsyncIterator[Setup]:
    async for s in _setup(tiny_path):
        yield s


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def test_required_tool_choice_gives_schema_valid_calls_for_20_seeds(tiny: Setup) -> None:
    async def one(seed: int) -> list[Any]:
        req = ChatRequest(
            user("Weather?"),
            tools=(WEATHER,),
            tool_choice=ToolChoice("required"),
            sampling=SamplingParams(temperature=1.0, seed=seed),
            max_tokens=200,
        )
        return await tiny.chat(req)

    results = await asyncio.gather(*(one(seed) for seed in range(20)))
    for events in results:
        calls = [e for e in events if isinstance(e, ToolCallEvent)]
        assert len(calls) == 1, events
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER.parameters)
        assert isinstance(events[-1], Finished)
        assert events[-1].reason == "tool_calls"
    arguments = {e.arguments for events in results for e in events if isinstance(e, ToolCallEvent)}
    assert len(arguments) > 1


async def test_a_named_tool_is_the_one_called(tiny: Setup) -> None:
    req = ChatRequest(
        user("Time?"),
        tools=(WEATHER, TIME),
        tool_choice=ToolChoice("function", "get_time"),
        sampling=SamplingParams(temperature=1.0, seed=3),
        max_tokens=200,
    )
    calls = [e for e in await tiny.chat(req) if isinstance(e, ToolCallEvent)]
    assert [c.name for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0].arguments), TIME.parameters)


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


async def test_structured_output_with_thinking(tiny: Setup) -> None:
    req = ChatRequest(
        user("Rate this."),
        format=Format("json_schema", SCHEMA),
        thinking=True,
        reasoning_budget=16,
        sampling=SamplingParams(temperature=0.8, seed=11),
        max_tokens=200,
    )
    events = await tiny.chat(req)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert reasoning, "the reasoning arrives separately"
    assert "</think>" not in content
    jsonschema.validate(json.loads(content), SCHEMA)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.usage.completion_tokens > 16
    assert finished.usage.prompt_reused > 0, "the answer continued the reasoning's sequence"


async def test_structured_output_without_thinking(tiny: Setup) -> None:
    req = ChatRequest(
        user("Rate this."),
        format=Format("json_schema", SCHEMA),
        sampling=SamplingParams(temperature=0.8, seed=5),
        max_tokens=200,
    )
    events = await tiny.chat(req)
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    jsonschema.validate(json.loads(content), SCHEMA)


def test_bad_requests_are_refused_before_generation() -> None:
    """The neutral rules hold for every dialect, before any lease (generation.check)."""
    ask = ApiRequest(model="m", dialect=Dialect.OPENAI, messages=(text("user", "x"),))
    for req, message in [
        (
            msgspec.structs.replace(
                ask, tools=(WEATHER,), tool_choice=ToolChoice("function", "nope")
            ),
            "not among",
        ),
        (
            msgspec.structs.replace(
                ask,
                tools=(WEATHER,),
                tool_choice=ToolChoice("required"),
                format=Format("json_object"),
            ),
            "cannot be combined",
        ),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            generation.check(req, LimitsConfig())


def test_dialect_shaped_image_parts_are_refused_by_prepare() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    req = ChatRequest(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    )
    with pytest.raises(InvalidRequest, match="text only"):
        prepare(req, template, lambda t: [1], detect_family(""))


@pytest.fixture
async def qwen(qwen_path: Path) -> AsyncIterator[Setup]:
    async for s in _setup(qwen_path, 4096):
        yield s


@pytest.mark.real_model
async def test_qwen_calls_the_weather_tool_for_paris(qwen: Setup) -> None:
    assert qwen.family.name == "hermes"
    tool = Tool(WEATHER.name, WEATHER.description, {**WEATHER.parameters, "required": ["city"]})
    req = ChatRequest(
        user("What is the weather in Paris?"),
        tools=(tool,),
        sampling=SamplingParams(temperature=0.0),
        max_tokens=96,
    )
    events = await qwen.chat(req)
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert calls, events
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] == "Paris"
    assert events[-1].reason == "tool_calls"


async def test_the_system_and_tools_head_is_pinned_and_timed(tiny: Setup) -> None:
    from barrel.metrics import Metrics

    metrics = Metrics()
    system = {"role": "system", "content": "You are a meticulous weather assistant. " * 8}
    prompts = []
    for question in ("Weather in Oslo?", "Weather in Lima?"):
        req = ChatRequest([system, *user(question)], tools=(WEATHER,), max_tokens=4)
        prep = prepare(req, tiny.template, tiny.model.tokenize, tiny.family)
        assert prep.static_prefix >= 64
        assert (
            prep.prompt[: prep.static_prefix]
            == tiny.model.tokenize(
                tiny.template.render(
                    [system], template_tools((WEATHER,)), add_generation_prompt=False
                )
            )[: prep.static_prefix]
        )
        events = [e async for e in run(tiny.engine, req, prep, metrics.pipeline_timings)]
        prompts.append(events[-1].usage)
    # The head is held in a pinned sequence, and the second conversation reuses it.
    assert tiny.engine.kv.pins[0].tokens == prep.prompt[: prep.static_prefix]
    assert prompts[1].prompt_reused >= prep.static_prefix
    count = metrics.registry.get_sample_value("barrel_pipeline_template_render_seconds_count")
    assert count == 2
    assert metrics.registry.get_sample_value("barrel_pipeline_output_parse_seconds_count") == 2


def test_go_templates_from_modelfiles_are_converted() -> None:
    from barrel.pipeline.templates import make_template

    template = make_template("{{ .System }}|{{ .Prompt }}|{{ .Response }}")
    assert template.render(user("hi")) == "|hi|"


def test_the_family_markers_that_are_control_tokens_are_preserved(tiny: Setup) -> None:
    harmony_like = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    from barrel.pipeline.families import family

    req = ChatRequest(user("x"), tools=(WEATHER,))
    prep = prepare(
        req, harmony_like, tiny.model.tokenize, family("hermes"), tiny.model.control_tokens
    )
    assert prep.preserve == frozenset(), "Qwen's <tool_call> is ordinary text already"
    prep = prepare(
        req, harmony_like, tiny.model.tokenize, family("harmony"), tiny.model.control_tokens
    )
    assert prep.preserve == frozenset(), "Qwen's vocabulary has no harmony tokens"
    im = family("hermes").__class__(
        "im", detect=(), starts=("<|im_start|>",), end="<|im_end|>", body="json"
    )
    prep = prepare(req, harmony_like, tiny.model.tokenize, im, tiny.model.control_tokens)
    expected = {tiny.model.token_id("<|im_start|>"), tiny.model.token_id("<|im_end|>")}
    assert prep.preserve == expected


async def test_a_cache_breakpoint_pins_up_to_its_message(tiny: Setup) -> None:
    document = {"role": "user", "content": "Here is a long report about the weather. " * 12}
    reply = {"role": "assistant", "content": "Noted."}
    messages = [document, reply, *user("Summarise it.")]
    plain = prepare(
        ChatRequest(messages, max_tokens=2), tiny.template, tiny.model.tokenize, tiny.family
    )
    req = ChatRequest(messages, max_tokens=2, pin_messages=2)
    prep = prepare(req, tiny.template, tiny.model.tokenize, tiny.family)
    assert plain.static_prefix == 0  # no system, no tools: nothing to pin by default
    marked = tiny.model.tokenize(
        tiny.template.render([document, reply], None, add_generation_prompt=False)
    )
    assert prep.static_prefix >= len(marked) - 2
    events = [e async for e in run(tiny.engine, req, prep)]
    assert isinstance(events[-1], Finished)
    assert any(p.tokens == prep.prompt[: prep.static_prefix] for p in tiny.engine.kv.pins)


def test_the_head_is_rendered_once_per_conversation(tiny: Setup) -> None:
    """A follow-up turn renders the conversation, not its system + tools head again: the
    head's tokens are kept by what was rendered."""
    template = ChatTemplate(tiny.model.meta("tokenizer.chat_template") or "")
    system = {"role": "system", "content": "You forecast the weather. " * 8}
    renders: list[int] = []
    original = template.render

    def counting(messages: Any, *args: Any, **kwargs: Any) -> str:
        renders.append(len(messages))
        return original(messages, *args, **kwargs)

    template.render = counting  # type: ignore[method-assign]
    firsts = []
    for question in ("Weather in Oslo?", "Weather in Lima?", "Weather in Oslo?"):
        req = ChatRequest([system, *user(question)], tools=(WEATHER,), max_tokens=4)
        prep = prepare(req, template, tiny.model.tokenize, tiny.family)
        firsts.append(prep.static_prefix)
    assert renders == [2, 1, 2, 2]  # the head (1 message) once, then whole prompts only
    assert firsts[0] == firsts[1] == firsts[2] >= 64
    other = {"role": "system", "content": "You forecast the tides. " * 8}
    prep = prepare(
        ChatRequest([other, *user("Hi")], tools=(WEATHER,)),
        template,
        tiny.model.tokenize,
        tiny.family,
    )
    assert renders[-2:] == [2, 1]  # another head is rendered
    assert prep.static_prefix >= 32


async def test_a_forced_call_is_written_in_the_family_s_own_syntax(tiny: Setup) -> None:
    assert tiny.family.name == "hermes"

    def tokenize_as(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return tiny.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    req = ChatRequest(
        user("Weather?"),
        tools=(WEATHER,),
        tool_choice=ToolChoice("required"),
        sampling=SamplingParams(temperature=1.0, seed=4),
        max_tokens=200,
    )
    prep = prepare(
        req, tiny.template, tiny.model.tokenize, tiny.family, tiny.model.control_tokens, tokenize_as
    )
    assert not prep.forced_call  # not a bare JSON object: the family's parser reads it
    (start,) = tokenize_as("<tool_call>", False, True)
    (end,) = tokenize_as("</tool_call>", False, True)
    _, done = await tiny.engine.submit(EngineRequest(prep.prompt, prep.sampling)).collect()
    assert done.tokens[0] == start
    assert done.tokens[-1] == end
    events = [e async for e in run(tiny.engine, req, prep)]
    (call,) = [e for e in events if isinstance(e, ToolCallEvent)]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER.parameters)
    assert events[-1].reason == "tool_calls"
