"""The tool-call and reasoning parser: every family, canonical and marker-stripped,
fed whole and one character at a time."""

from __future__ import annotations

import json

import pytest

from barrel.pipeline.events import ReasoningDelta as Reasoning
from barrel.pipeline.events import TextDelta as Text
from barrel.pipeline.events import ToolArgsDelta, ToolCallStart
from barrel.pipeline.events import ToolCallEvent as ToolCall
from barrel.pipeline.families import family
from barrel.pipeline.toolcalls import ToolCallParser

TOOLS = ["get_weather", "get_time"]
PARIS = {"city": "Paris"}
TOKYO = {"city": "Tokyo", "days": 2}
DS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"

# (family, output, expected content, expected calls)
CASES = [
    (
        "hermes",
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "firefunction",
        ' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        " ",
        [("get_weather", PARIS)],
    ),
    ("glm45", "get_weather\ncity\nParis\n", "", [("get_weather", PARIS)]),
    (
        "mistral-args",
        'get_weather{"city": "Paris"}get_time{"city": "Tokyo", "days": 2}',
        "",
        [("get_weather", PARIS), ("get_time", TOKYO)],
    ),
    (
        "hermes",
        "Let me check.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", PARIS)],
    ),
    (
        "hermes",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"city": "Tokyo", "days": 2}}</tool_call>',
        "\n",
        [("get_weather", PARIS), ("get_time", TOKYO)],
    ),
    (
        "qwen3-coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        [("get_weather", PARIS)],
    ),
    (
        "qwen3-coder",
        "<function=get_time>\n<parameter=city>\nTokyo\n</parameter>\n<parameter=days>\n2\n"
        "</parameter>\n</function>",
        "",
        [("get_time", TOKYO)],
    ),
    (
        "glm45",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "",
        [("get_weather", PARIS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "mistral",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "mistral-args",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
        '{"city": "Tokyo", "days": 2}',
        "",
        [("get_weather", PARIS), ("get_time", TOKYO)],
    ),
    (
        "phi4-functools",
        'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "llama-python-tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "llama-python-tag",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "llama-pythonic",
        "[get_weather(city='Paris'), get_time(city=\"Tokyo\", days=2)]",
        "",
        [("get_weather", PARIS), ("get_time", TOKYO)],
    ),
    (
        "dsml",
        f'{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```'
        f"{DS_CALL_END}{DS_END}",
        "",
        [("get_weather", PARIS)],
    ),
    ("dsml", 'functionget_weather\n```json\n{"city": "Paris"}\n```', "", [("get_weather", PARIS)]),
    (
        "harmony",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "harmony",
        'commentary to=functions.get_weather json{"city": "Paris"}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "generic",
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "generic",
        '{"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}',
        "",
        [("get_weather", PARIS)],
    ),
]


def run(
    fam: str, chunks: list[str], tools: list[str] = TOOLS
) -> tuple[str, str, list[tuple[str, dict]]]:
    parser = ToolCallParser(family(fam), tools)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    text = "".join(e.text for e in events if isinstance(e, Text))
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    assert all(len(e.id) == 9 and e.id.isalnum() for e in events if isinstance(e, ToolCall))
    return text, reasoning, calls


@pytest.mark.parametrize(("fam", "output", "content", "calls"), CASES)
def test_families_whole_and_one_character_at_a_time(
    fam: str, output: str, content: str, calls: list[tuple[str, dict]]
) -> None:
    for chunks in ([output], list(output)):
        text, _, got = run(fam, chunks)
        assert got == calls, (fam, chunks[:3])
        assert text == content


@pytest.mark.parametrize("fam", ["hermes", "qwen3-coder", "generic", "dsml"])
def test_reasoning_is_separated(fam: str) -> None:
    output = "<think>Weather needs a tool.</think>\nSure, checking."
    for chunks in ([output], list(output)):
        text, reasoning, calls = run(fam, chunks)
        assert reasoning == "Weather needs a tool."
        assert text == "Sure, checking."
        assert calls == []


def test_text_that_is_not_a_call_stays_content() -> None:
    for fam, output in [
        ("hermes", "<tool_call>not json at all</tool_call> after"),
        ("hermes", '{"name": "rm_rf", "arguments": {}}'),  # not one of the request's tools
        ("hermes", "{ this is prose in braces }"),
        ("mistral", "[TOOL_CALLS] broken"),
        ("llama-pythonic", "[1, 2, 3] are numbers"),
    ]:
        for chunks in ([output], list(output)):
            text, _, calls = run(fam, chunks)
            assert calls == []
            assert text.replace("\n", "") == output.replace("\n", ""), (fam, text)


def test_no_tools_means_no_calls() -> None:
    text, _, calls = run(
        "hermes", ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'], []
    )
    assert calls == []
    assert "get_weather" in text


def test_plain_text_streams_before_the_end() -> None:
    parser = ToolCallParser(family("hermes"), TOOLS)
    assert parser.feed("Hello there, ") == [Text("Hello there, ")]
    assert parser.feed("this is <tool") == [Text("this is ")], "a marker prefix is held"
    assert parser.feed("bar> ok") == [Text("<toolbar> ok")]


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PRETTY = '{\n    "name": "get_weather",\n    "arguments": {\n        "city": "Paris"\n    }\n}'
SPACED = '{ "name" : "get_weather" , "arguments" : { "city" : "Paris" } }'
# (output, the content around the call); every shape Qwen2.5-Coder was seen to write
WRAPPED = [
    (CALL, ""),
    (PRETTY, ""),
    (SPACED, ""),
    ("\n\n" + PRETTY + "\n", ""),
    (PRETTY + "\n```", ""),  # a stray closing fence
    ("```json\n" + PRETTY + "\n```", ""),
    ("```\n" + CALL + "\n```\n", ""),
    ("Sure! " + PRETTY, "Sure! "),
    (
        "I will check the weather.\n\n" + CALL + "\n\nOne moment.",
        "I will check the weather.\n\n\n\nOne moment.",
    ),
    ("Let me look:\n```json\n" + SPACED + "\n```\nDone.", "Let me look:\n\nDone."),
    ("<tool_call>\n" + PRETTY + "\n</tool_call>", ""),
]


@pytest.mark.parametrize(("fam", "shape"), [(f, w) for f in ("hermes", "generic") for w in WRAPPED])
def test_a_call_object_in_any_whitespace_fence_or_prose_is_a_call(
    fam: str, shape: tuple[str, str]
) -> None:
    output, content = shape
    if fam == "generic" and "<tool_call>" in output:
        return  # hermes' own markers
    for chunks in ([output], list(output)):
        text, _, calls = run(fam, chunks)
        assert calls == [("get_weather", PARIS)], (fam, output, len(chunks))
        assert text == content, (fam, output, len(chunks))


def test_braces_that_are_not_a_call_stay_text_in_order() -> None:
    output = 'Use {x} and {"a": 1} then ```python\nprint({1: 2})\n``` end'
    for chunks in ([output], list(output)):
        text, _, calls = run("hermes", chunks)
        assert calls == []
        assert text == output


@pytest.mark.parametrize(
    ("output", "args"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Par', {"city": "Par"}),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "un',
            {"city": "Paris"},
        ),
        ('{"name": "get_weather", "argu', {}),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}', {"city": "Paris"}),
    ],
)
def test_a_call_cut_short_is_a_call_with_the_arguments_so_far(output: str, args: dict) -> None:
    for chunks in ([output], list(output)):
        text, _, calls = run("hermes", chunks)
        assert calls == [("get_weather", args)], output
        assert text == ""


STREAMED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"note": "a } and a \\" inside"}}\n</tool_call>',
    ),
    ("generic", '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'),
    ("generic", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'),
    ("hermes", 'Checking.\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),
]


@pytest.mark.parametrize(("fam", "output"), STREAMED)
def test_arguments_stream_as_they_are_written(fam: str, output: str) -> None:
    """Fed a character at a time, a call starts once its name is a declared tool's,
    its arguments come in pieces as written (never the call's own closing brace), and
    the whole call ends it, marked streamed, with the same id and the same arguments."""
    parser = ToolCallParser(family(fam), TOOLS)
    events = []
    for ch in output:
        events += parser.feed(ch)
    events += parser.finish()
    kinds = [type(e) for e in events if not isinstance(e, Text)]
    assert kinds[0] is ToolCallStart
    assert kinds[-1] is ToolCall
    assert set(kinds[1:-1]) == {ToolArgsDelta}
    assert len(kinds) > 5
    start, end = events[[type(e) for e in events].index(ToolCallStart)], events[-1]
    assert isinstance(end, ToolCall)
    assert (start.id, start.name) == (end.id, end.name)
    assert end.streamed
    pieces = "".join(e.text for e in events if isinstance(e, ToolArgsDelta))
    assert json.loads(pieces) == json.loads(end.arguments)
    text = "".join(e.text for e in events if isinstance(e, Text))
    assert text.strip() in ("", "Checking.")


@pytest.mark.parametrize(
    ("cut", "args"),
    [
        ('{"city": "Par', {"city": "Par"}),
        ('{"city', {}),
        ('{"city":', {"city": None}),
        ('{"city": "Paris", ', {"city": "Paris"}),
        ('{"city": "Paris", "un', {"city": "Paris"}),
        ('{"days": [1, 2', {"days": [1, 2]}),
    ],
)
def test_a_streamed_call_cut_short_ends_with_what_was_written(cut: str, args: dict) -> None:
    parser = ToolCallParser(family("hermes"), TOOLS)
    events = []
    for ch in '<tool_call>\n{"name": "get_weather", "arguments": ' + cut:
        events += parser.feed(ch)
    events += parser.finish()
    assert isinstance(events[0], ToolCallStart)
    assert isinstance(events[-1], ToolCall)
    assert json.loads(events[-1].arguments) == args
    pieces = "".join(e.text for e in events if isinstance(e, ToolArgsDelta))
    assert json.loads(pieces) == args  # completed by the last piece


def test_an_undeclared_name_never_starts_a_call() -> None:
    parser = ToolCallParser(family("generic"), TOOLS)
    events = []
    for ch in '{"name": "rm_rf", "arguments": {"path": "/"}}':
        events += parser.feed(ch)
    events += parser.finish()
    assert not any(isinstance(e, ToolCallStart | ToolArgsDelta | ToolCall) for e in events)
