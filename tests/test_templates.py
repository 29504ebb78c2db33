"""Chat templates render in the sandbox: every template llama.cpp ships, and the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from barrel.pipeline.chat import ChatRequest
from barrel.pipeline.families import detect_family
from barrel.pipeline.prompt import TOOL_INSTRUCTIONS, prepare, template_tools
from barrel.pipeline.request import Tool, ToolChoice
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
# The tool-call family each shipped template is detected as. "generic" means none of
# the families the parser knows (bare JSON calls are still recognised).
EXPECTED_FAMILIES = {
    "Apertus-8B-Instruct.jinja": "generic",
    "Apriel-1.6-15b-Thinker-fixed.jinja": "generic",
    "Bielik-11B-v3.0-Instruct.jinja": "hermes",
    "ByteDance-Seed-OSS.jinja": "qwen3-coder",
    "Cohere2MoE.jinja": "generic",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "generic",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "generic",
    "GLM-4.6.jinja": "glm45",
    "GLM-4.7-Flash.jinja": "glm45",
    "GigaChat3-10B-A1.8B.jinja": "generic",
    "GigaChat3.1-10B-A1.8B.jinja": "generic",
    "HuggingFaceTB-SmolLM3-3B.jinja": "generic",
    "Kimi-K2-Instruct.jinja": "generic",
    "Kimi-K2-Thinking.jinja": "generic",
    "Kimi-K3.jinja": "generic",
    "LFM2-8B-A1B.jinja": "generic",
    "LFM2.5-8B-A1B.jinja": "generic",
    "LFM2.5-Instruct.jinja": "generic",
    "MiMo-VL.jinja": "hermes",
    "MiniMax-M1.jinja": "generic",
    "MiniMax-M2.jinja": "generic",
    "MiniMax-M3.jinja": "hermes",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "mistral-args",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "qwen3-coder",
    "NVIDIA-Nemotron-Nano-v2.jinja": "generic",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": "hermes",
    "Qwen-QwQ-32B.jinja": "hermes",
    "Qwen-Qwen2.5-7B-Instruct.jinja": "hermes",
    "Qwen-Qwen3-0.6B.jinja": "hermes",
    "Qwen3-Coder.jinja": "qwen3-coder",
    "Qwen3.5-4B.jinja": "qwen3-coder",
    "Reka-Edge.jinja": "hermes",
    "Spark2.5.jinja": "glm45",
    "StepFun3.5-Flash.jinja": "qwen3-coder",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "dsml",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "dsml",
    "deepseek-ai-DeepSeek-V3.1.jinja": "dsml",
    "deepseek-ai-DeepSeek-V3.2.jinja": "generic",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "generic",
    "deepseek-ai-DeepSeek-V4.jinja": "generic",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "firefunction",
    "google-gemma-2-2b-it.jinja": "generic",
    "google-gemma-4-31B-it-interleaved.jinja": "generic",
    "google-gemma-4-31B-it.jinja": "generic",
    "ibm-granite-granite-3.3-2B-Instruct.jinja": "generic",
    "ibm-granite-granite-4.0.jinja": "hermes",
    "ibm-granite-granite-4.1.jinja": "hermes",
    "inclusionai-ling-3.0-flash.jinja": "glm45",
    "llama-cpp-deepseek-r1.jinja": "dsml",
    "llama-cpp-rwkv-world.jinja": "generic",
    "meetkai-functionary-medium-v3.1.jinja": "llama-python-tag",
    "meetkai-functionary-medium-v3.2.jinja": "generic",
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama-python-tag",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "generic",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "llama-python-tag",
    "microsoft-Phi-3.5-mini-instruct.jinja": "generic",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "mistral-args",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral",
    "moonshotai-Kimi-K2.jinja": "generic",
    "muse-glimmer.jinja": "generic",
    "openai-gpt-oss-120b.jinja": "harmony",
    "openbmb-MiniCPM5-1B.jinja": "generic",
    "poolside-Laguna-S-2.1.jinja": "glm45",
    "poolside-Laguna-XS-2.1.jinja": "glm45",
    "poolside-Laguna-XS.2.jinja": "glm45",
    "tencent-Hy3.jinja": "generic",
    "unsloth-Apriel-1.5.jinja": "hermes",
    "unsloth-mistral-Devstral-Small-2507.jinja": "mistral-args",
    "upstage-Solar-Open-100B.jinja": "generic",
}


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


def test_every_shipped_template_has_its_family_detected(llama_templates: Path) -> None:
    names = template_names(llama_templates)
    detected = {n: detect_family((llama_templates / n).read_text()).name for n in names}
    assert detected == EXPECTED_FAMILIES
    assert {
        "hermes",
        "qwen3-coder",
        "glm45",
        "dsml",
        "mistral",
        "mistral-args",
        "llama-python-tag",
        "harmony",
        "firefunction",
    } <= set(detected.values())


def test_tools_reach_the_prompt_of_templates_that_print_none(llama_templates: Path) -> None:
    """Phi-3.5's template takes `tools` and prints nothing of them: the definitions and
    the call format join the system message; a template that prints them is left alone."""

    def by_bytes(text: str) -> list[int]:
        return list(text.encode())

    phi = ChatTemplate((llama_templates / "microsoft-Phi-3.5-mini-instruct.jinja").read_text())
    assert not phi.renders_tools
    weather = Tool(**TOOLS[0]["function"])
    assert template_tools((weather,)) == TOOLS
    req = ChatRequest([{"role": "user", "content": "Weather in Paris?"}], tools=(weather,))
    prompt = bytes(prepare(req, phi, by_bytes, detect_family(phi.source)).prompt).decode()
    assert TOOL_INSTRUCTIONS in prompt
    assert '"name": "get_weather"' in prompt
    assert prompt.index("get_weather") < prompt.index("Weather in Paris?")
    none = ChatRequest(req.messages, tools=(weather,), tool_choice=ToolChoice("none"))
    assert (
        "get_weather"
        not in bytes(prepare(none, phi, by_bytes, detect_family(phi.source)).prompt).decode()
    )
    hermes = ChatTemplate((llama_templates / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    assert hermes.renders_tools
    text = bytes(prepare(req, hermes, by_bytes, detect_family(hermes.source)).prompt).decode()
    assert TOOL_INSTRUCTIONS not in text
    assert "get_weather" in text
