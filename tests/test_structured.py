"""Structured output through the daemon, on Qwen2.5-Coder-0.5B: every field clients ask
for it by (OpenAI's, llama-server's, vLLM's, Anthropic's; chat and completions), a
sample of the corpus of real-world schemas each answered with a valid document or
refused with a 400 naming what is unsupported (the whole corpus: bench/corpus.py, and
tests/test_structured_corpus.py without a model), and schemas built to be expensive
that neither hang nor hold back another client's request."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.daemon import Daemon, serve_models
from tests.schema_corpus import check, corpus, request


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, qwen_path: Path) -> Iterator[Daemon]:
    d = serve_models(
        tmp_path_factory.mktemp("structured"),
        {"qwen": qwen_path},
        "[models.defaults]\nnum_seq_max = 4\n",
    )
    yield d
    d.kill()


def chat(daemon: Daemon, content: str, **body: Any) -> httpx.Response:
    payload = {
        "model": "qwen",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 200,
        **body,
    }
    return httpx.post(daemon.url + "/v1/chat/completions", json=payload, timeout=300)


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    return text


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


# -- the fields ----------------------------------------------------------------------------


def test_llama_server_s_json_schema_and_json_object_with_a_schema(daemon: Daemon) -> None:
    ask = "Describe a person as JSON."
    for body in (
        {"json_schema": PERSON},
        {"response_format": {"type": "json_object", "schema": PERSON}},
    ):
        document = json.loads(answer(chat(daemon, ask, **body)))
        jsonschema.validate(document, PERSON)
        assert set(document) == {"name", "age"}
    document = json.loads(answer(chat(daemon, ask, response_format={"type": "json_object"})))
    assert isinstance(document, dict)


def test_a_gbnf_or_lark_grammar_shapes_the_answer_and_a_bad_one_is_a_400(daemon: Daemon) -> None:
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    text = answer(chat(daemon, "What is 6 times 7?", grammar=gbnf))
    assert re.fullmatch(r"The answer is [0-9]+\.", text), text
    lark = 'start: "colour: " ("red" | "green" | "blue")'
    text = answer(chat(daemon, "Name a colour.", grammar=lark))
    assert text in ("colour: red", "colour: green", "colour: blue")
    for bad in ('root ::= "a" undefined', "root ::= ((("):
        r = chat(daemon, "x", grammar=bad)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "grammar" in r.json()["error"]["message"]


def test_vllm_s_structured_outputs(daemon: Daemon) -> None:
    text = answer(chat(daemon, "Is water wet?", structured_outputs={"choice": ["yes", "no"]}))
    assert text in ("yes", "no")
    text = answer(chat(daemon, "A date?", structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]"}))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", text), text
    document = json.loads(
        answer(chat(daemon, "A person as JSON.", structured_outputs={"json": json.dumps(PERSON)}))
    )
    jsonschema.validate(document, PERSON)
    text = answer(chat(daemon, "Say hi.", structured_outputs={"grammar": 'start: "hi" | "hello"'}))
    assert text in ("hi", "hello")
    r = chat(daemon, "x", structured_outputs={"regex": "a", "choice": ["b"]})
    assert r.status_code == 400
    assert "exactly one" in r.json()["error"]["message"]
    r = chat(daemon, "x", structured_outputs={"choice": ["a"]}, json_schema=PERSON)
    assert r.status_code == 400
    assert "not several" in r.json()["error"]["message"]


def test_completions_take_a_json_schema(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
    r = client.completions.create(
        model="qwen",
        prompt="A person, as JSON: ",
        max_tokens=100,
        temperature=0,
        extra_body={"json_schema": PERSON},
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


class Capital(BaseModel):
    country: str
    capital: str


def test_anthropic_s_output_config_format(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0, timeout=300)
    parsed = client.messages.parse(
        model="qwen",
        max_tokens=100,
        # the facts are in the question: the test is of the format, not of what the model
        # knows (from memory it answered "Frankfurt" once in seven runs, a near tie)
        messages=[{"role": "user", "content": "Paris is the capital of France. Which?"}],
        output_format=Capital,
    )
    assert parsed.parsed_output is not None
    assert "Paris" in parsed.parsed_output.capital
    raw = httpx.post(
        daemon.url + "/v1/messages",
        json={
            "model": "qwen",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "output_format": {"type": "json_schema", "schema": PERSON},
        },
        timeout=300,
    )
    assert raw.status_code == 200, raw.text
    jsonschema.validate(json.loads(raw.json()["content"][0]["text"]), PERSON)


def test_forced_tokens_are_counted(daemon: Daemon) -> None:
    answer(chat(daemon, "Describe a person as JSON.", json_schema=PERSON))
    metrics = httpx.get(daemon.url + "/metrics", timeout=30).text
    (value,) = re.findall(r'barrel_engine_forced_tokens_total\{model="qwen"\} ([0-9.e+]+)', metrics)
    assert float(value) > 0


# -- the corpus ----------------------------------------------------------------------------

# Every 14th schema of the corpus through Qwen (15 of them: pydantic, strict and LangChain
# forms, hand-written keywords, a refusal); the whole corpus runs in bench/corpus.py, and
# tests/test_structured_corpus.py reads all of its recorded answers without a model.
SAMPLE = corpus()[::14]


# ~1 minute of Qwen decoding on a 2-core box
@pytest.mark.timeout(900)
def test_a_sample_of_real_world_schemas_is_answered_or_refused(daemon: Daemon) -> None:
    assert len(SAMPLE) >= 15

    async def all_of() -> list[httpx.Response]:
        gate = asyncio.Semaphore(4)
        async with httpx.AsyncClient() as client:

            async def one(schema: dict[str, Any], how: str) -> httpx.Response:
                async with gate:
                    url = daemon.url + "/v1/chat/completions"
                    return await client.post(url, json=request(schema, how), timeout=600)

            return await asyncio.gather(*(one(s, how) for _, s, how in SAMPLE))

    answers = asyncio.run(all_of())
    failures = [
        f
        for (name, schema, how), r in zip(SAMPLE, answers, strict=True)
        if (f := check(name, schema, how, r.status_code, r.json()))
    ]
    assert not failures, "\n".join(failures)
    assert any(r.status_code == 200 for r in answers)


# -- expensive schemas -----------------------------------------------------------------------

EXPENSIVE: list[tuple[str, dict[str, Any]]] = [
    ("counted repetition", {"type": "string", "pattern": "^(a|b){0,5000}c{1000}$"}),
    ("expanded optional repetition", {"type": "string", "pattern": "^(a?){200}a{200}$"}),
    ("nested counted", {"type": "string", "pattern": "^((ab){1,50}(cd){1,50}){1,50}$"}),
    (
        "near-identical alternation",
        {"anyOf": [{"const": f"option number {i:04d}"} for i in range(1500)]},
    ),
    ("huge enum", {"enum": [f"value-{i}-{'x' * (i % 7)}" for i in range(3500)]}),
    (
        "deep nesting",
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"n": {"$ref": "#/$defs/n"}},
                    "required": ["n"],
                }
            },
            "$ref": "#/$defs/n",
        },
    ),
    (
        "huge lengths",
        {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 100000, "maxLength": 1000000}},
            "required": ["s"],
        },
    ),
    ("many items", {"type": "array", "items": {"type": "integer"}, "minItems": 100000}),
]


def test_expensive_schemas_are_answered_or_refused(daemon: Daemon) -> None:
    results: dict[str, httpx.Response] = {}

    def send(name: str, schema: dict[str, Any]) -> None:
        results[name] = chat(
            daemon,
            "Write a value.",
            max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )

    workers = [threading.Thread(target=send, args=item) for item in EXPENSIVE]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    for name, schema in EXPENSIVE:
        r = results[name]
        if r.status_code == 400:
            assert "grammar" in r.json()["error"]["message"], (name, r.text)
            continue
        assert r.status_code == 200, (name, r.text)
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        else:  # cut by max_tokens: what there is follows the grammar so far
            assert choice["finish_reason"] == "length"
            assert choice["message"]["content"][:1] in ('"', "[", "{"), (name, r.text)
    assert httpx.get(daemon.url + "/health", timeout=30).status_code == 200


def _stream(
    daemon: Daemon,
    body: dict[str, Any],
    started: threading.Event,
    ended: threading.Event,
    leave: threading.Event | None = None,
) -> None:
    """Read a streamed answer; `started` at its first text, `ended` when it ended or the
    client left it (once `leave` is set: the daemon cancels what it generates)."""
    payload = {"model": "qwen", "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=payload, timeout=600) as r:
        for line in r.iter_lines():
            if '"content":"' in line:
                started.set()
            if leave is not None and leave.is_set():
                break
    started.set()
    ended.set()


def test_a_plain_request_streams_while_costly_grammars_generate(daemon: Daemon) -> None:
    costly = [schema for name, schema in EXPENSIVE if name in ("huge lengths", "many items")]
    events = []
    leave = threading.Event()  # the costly answers are left once the point is made
    for schema in costly:
        started, ended = threading.Event(), threading.Event()
        body = {
            "messages": [{"role": "user", "content": "Write a value."}],
            "max_tokens": 1500,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
        threading.Thread(
            target=_stream, args=(daemon, body, started, ended, leave), daemon=True
        ).start()
        events.append((started, ended))
    for started, _ in events:
        assert started.wait(300)  # both generate under their grammars
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    # the first token came while both were still generating (1,500 tokens each)
    assert not any(ended.is_set() for _, ended in events)
    assert first.choices[0].delta.content
    for _ in stream:
        pass
    leave.set()  # their 1,500 tokens each prove nothing more: the daemon cancels them
    for _, ended in events:
        assert ended.wait(600)
