"""Session ids and Go TEMPLATE conversion."""

from __future__ import annotations

import pytest

from barrel.pipeline.gotemplate import UnsupportedTemplate, go_to_jinja, is_go_template
from barrel.pipeline.session import derive_session
from barrel.pipeline.templates import ChatTemplate


def test_session_ids() -> None:
    turn1 = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    assert derive_session("m", turn1) == derive_session("m", turn2), "stable across turns"
    assert derive_session("m", turn1) != derive_session("other", turn1)
    assert derive_session("m", turn1) != derive_session("m", [{"role": "user", "content": "bye"}])
    assert derive_session("m", turn1, conversation_id="conv-7") == "conv-7"
    assert derive_session("m", turn1, user_id="user_42") == "user_42"
    assert derive_session("m", turn1, conversation_id="conv 7 \n") == derive_session("m", turn1)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    assert derive_session("m", parts) == derive_session("m", turn1[1:])


def test_go_template_conversion() -> None:
    go = (
        "{{ if .System }}<|system|>{{ .System }}\n{{ end }}"
        "<|user|>{{ .Prompt }}\n<|assistant|>{{ .Response }}"
    )
    assert is_go_template(go)
    assert not is_go_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    template = ChatTemplate(go_to_jinja(go))
    text = template.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "{{ not jinja }}"},
        ]
    )
    assert text == (
        "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>Hello!<|user|>{{ not jinja }}\n<|assistant|>"
    )


def test_complex_go_templates_are_refused() -> None:
    for go in (
        "{{ range .Messages }}{{ .Content }}{{ end }}",
        "{{ if .Tools }}x{{ end }}",
        "{{ if .System }}",
    ):
        with pytest.raises(UnsupportedTemplate) as info:
            go_to_jinja(go)
        assert info.value.status == 400


def test_a_forced_call_keeps_the_references_of_its_tools_parameters() -> None:
    """A tool whose parameters use `$defs` / `definitions` (pydantic's nested models,
    draft-07 schemas) or refer to their own root is forced as a call whose grammar
    resolves those references (they are read from the call's root): several tools'
    definitions of one name stay apart."""
    import llguidance

    from barrel.pipeline.chat import ChatRequest
    from barrel.pipeline.formats import json_schema_grammar
    from barrel.pipeline.prompt import forced_schema
    from barrel.pipeline.request import Tool, ToolChoice

    node = {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"]}
    a = Tool(
        "a",
        "",
        {
            "$defs": {"n": node},
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/n"}},
            "required": ["x"],
        },
    )
    b = Tool(
        "b",
        "",
        {
            "definitions": {"n": {"type": "integer"}},
            "type": "object",
            "properties": {"y": {"$ref": "#/definitions/n"}, "z": {"$ref": "#/properties/y"}},
            "required": ["y", "z"],
        },
    )
    schema = forced_schema(ChatRequest([], tools=(a, b), tool_choice=ToolChoice("required")))
    assert schema is not None
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, json_schema_grammar(schema))
    assert not matcher.is_error(), matcher.get_error()

    def reads(text: str) -> bool:
        m = llguidance.LLMatcher(tokenizer, json_schema_grammar(schema))
        tokens = tokenizer.tokenize_bytes(text.encode())
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    assert reads('{"name": "a", "arguments": {"x": {"v": "hi"}}}')
    assert reads('{"name": "b", "arguments": {"y": 1, "z": 2}}')
    assert not reads('{"name": "b", "arguments": {"y": "1", "z": 2}}')  # b's n, not a's
    assert not reads('{"name": "a", "arguments": {"x": 3}}')
