"""Chat templates render in the sandbox: every template llama.cpp ships, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from barrel.pipeline.templates import ChatTemplate, TemplateError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    }
]
CALL_ID = "call0abcd"  # nine alphanumerics: Mistral's templates insist
CONVERSATION = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather", "content": '{"celsius": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
    {"role": "user", "content": "And tomorrow?"},
]
TEMPLATE_DIR = Path("llama-cpp-templates")


def template_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.jinja"))


def test_every_shipped_template_renders_a_tool_conversation(llama_templates: Path) -> None:
    names = template_names(llama_templates)
    assert len(names) >= 60, "the sdist's templates were found"
    failures = {}
    for name in names:
        template = ChatTemplate((llama_templates / name).read_text(), "<s>", "</s>")
        try:
            text = template.render(CONVERSATION, TOOLS, add_generation_prompt=True)
        except TemplateError as exc:
            failures[name] = exc.message
            continue
        for expected in ("What is the weather in Paris?", "And tomorrow?", "21"):
            if expected not in text:
                failures[name] = f"{expected!r} missing"
    assert failures == {}


def test_system_and_tool_roles_are_adapted_when_a_template_lacks_them(
    llama_templates: Path,
) -> None:
    gemma = ChatTemplate((llama_templates / "google-gemma-2-2b-it.jinja").read_text())
    assert not gemma.supports_system
    assert not gemma.supports_tool_results
    text = gemma.render(CONVERSATION, TOOLS)
    assert "You are a weather assistant." in text
    assert "tool_response" in text
    qwen = ChatTemplate((llama_templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    assert qwen.supports_system
    assert qwen.supports_tool_results
    assert qwen.object_arguments
    text = qwen.render(CONVERSATION, TOOLS)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert text.endswith("<|im_start|>assistant\n")


def test_template_kwargs_reach_the_template(llama_templates: Path) -> None:
    qwen3 = ChatTemplate((llama_templates / "Qwen-Qwen3-0.6B.jinja").read_text())
    messages = [{"role": "user", "content": "hi"}]
    assert qwen3.render(messages, enable_thinking=False) != qwen3.render(
        messages, enable_thinking=True
    )
    assert "<think>\n\n</think>" in qwen3.render(messages, enable_thinking=False)


def test_template_failures_are_400s() -> None:
    with pytest.raises(TemplateError, match="does not parse") as info:
        ChatTemplate("{% for %}")
    assert info.value.status == 400
    refusing = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    with pytest.raises(TemplateError, match="user first"):
        refusing.render([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    unsafe = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TemplateError, match="unsafe"):
        unsafe.render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate("   ")


def test_helpers() -> None:
    t = ChatTemplate("{{ strftime_now('%Y') }}|{{ messages | tojson }}|{{ bos_token }}")
    year, body, bos = t.render(
        [{"role": "user", "content": "é"}], add_generation_prompt=False
    ).split("|")
    assert len(year) == 4
    assert year.isdigit()
    assert body == '[{"role": "user", "content": "é"}]', (
        "tojson keeps non-ASCII and does not HTML-escape"
    )
    assert bos == ""
