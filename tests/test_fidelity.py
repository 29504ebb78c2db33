"""Requests real clients send that llama-server and vLLM take: JSON null for optional
fields, OpenAI's routes without /v1, assistant prefill (`continue_final_message`),
`system_fingerprint` on completions, and no boolean read as a token id. Real daemon,
the official SDKs and raw HTTP."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.daemon import Daemon, serve_models


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, qwen_path: Path
) -> Iterator[Daemon]:
    d = serve_models(tmp_path_factory.mktemp("fidelity"), {"tiny": tiny_path, "qwen": qwen_path})
    yield d
    d.kill()


def _chat(daemon: Daemon, path: str = "/v1/chat/completions", **body: object) -> httpx.Response:
    payload = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 4,
        "temperature": 0,
        **body,
    }
    return httpx.post(daemon.url + path, json=payload, timeout=120)


def test_null_optional_fields_are_fields_not_sent(daemon: Daemon) -> None:
    plain = _chat(daemon)
    assert plain.status_code == 200, plain.text
    nulls = {
        "tools": None,
        "n": None,
        "logprobs": None,
        "parallel_tool_calls": None,
        "tool_choice": None,
        "stop": None,
        "top_logprobs": None,
        "response_format": None,
        "stream": None,
        "user": None,
    }
    r = _chat(daemon, **nulls)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1
    assert body["choices"][0]["logprobs"] is None
    assert (
        body["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    )
    # a wrong type is still a 400 naming the field
    bad = _chat(daemon, n="many")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "n"


def test_openai_routes_answer_without_v1(daemon: Daemon) -> None:
    bare = openai.OpenAI(base_url=daemon.url, api_key="none", max_retries=0, timeout=120)
    v1 = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}]}
    a = bare.chat.completions.create(**ask, max_tokens=4, temperature=0)  # type: ignore[call-overload]
    b = v1.chat.completions.create(**ask, max_tokens=4, temperature=0)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content
    completion = bare.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0)
    assert (
        completion.choices[0].text
        == v1.completions.create(model="tiny", prompt="def f(", max_tokens=4, temperature=0)
        .choices[0]
        .text
    )
    vectors = bare.embeddings.create(model="tiny", input=["hello", "world"])
    assert len(vectors.data) == 2
    assert {m.id for m in bare.models.list()} == {m.id for m in v1.models.list()}
    assert bare.models.retrieve("tiny").id == "tiny"
    response = bare.responses.create(model="tiny", input="Say hi", max_output_tokens=4)
    assert response.output_text
    assert bare.responses.retrieve(response.id).id == response.id
    with pytest.raises(openai.NotFoundError) as missing:  # OpenAI's envelope there too
        bare.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_completions_carry_the_system_fingerprint(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    completion = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert completion.system_fingerprint == chat.system_fingerprint
    assert completion.system_fingerprint
    stream = client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)
    assert {c.system_fingerprint for c in stream} == {chat.system_fingerprint}


def test_booleans_are_never_token_ids(daemon: Daemon) -> None:
    for value in ([[False]], [True, 1], [[1, False]]):
        r = httpx.post(
            daemon.url + "/v1/embeddings", json={"model": "tiny", "input": value}, timeout=60
        )
        assert r.status_code == 400, (value, r.text)
        assert r.json()["error"]["param"].startswith("input")
    ok = httpx.post(daemon.url + "/v1/embeddings", json={"model": "tiny", "input": [[1, 2]]})
    assert ok.status_code == 200


def test_continue_final_message_continues_the_answer(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Count from 1 to 30, separated by spaces."}]
    whole = (
        client.chat.completions.create(
            model="qwen",
            messages=ask,
            max_tokens=40,
            temperature=0,  # type: ignore[arg-type]
        )
        .choices[0]
        .message.content
    )
    assert whole is not None
    cut = whole.index(" 7")  # the answer so far: "1 2 3 4 5 6"
    started = whole[:cut]
    go_on = (
        client.chat.completions.create(
            model="qwen",
            messages=[*ask, {"role": "assistant", "content": started}],  # type: ignore[list-item]
            max_tokens=8,
            temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        .choices[0]
        .message.content
    )
    assert go_on
    assert whole[cut:].startswith(go_on)  # it picks up where the answer stopped
    # without the flag the assistant message is a finished turn: a new answer begins
    fresh = (
        client.chat.completions.create(
            model="qwen",
            messages=[*ask, {"role": "assistant", "content": started}],  # type: ignore[list-item]
            max_tokens=8,
            temperature=0,
        )
        .choices[0]
        .message.content
    )
    assert fresh != go_on

    for extra, word in (
        ({"continue_final_message": True, "add_generation_prompt": True}, "both"),
        ({"continue_final_message": True}, "final assistant message"),
    ):
        messages = [*ask, {"role": "assistant", "content": started}] if word == "both" else ask
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model="qwen",
                messages=messages,
                max_tokens=2,
                extra_body=extra,  # type: ignore[arg-type]
            )
        assert word in refused.value.message


def _loads(url: str, model: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf'^barrel_model_loads_total{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow  # a loop of loads or a gateway's polls: out of `make check`
def test_a_request_is_served_by_the_load_it_waited_for(tmp_path: Path, tiny_path: Path) -> None:
    """One client loops Ollama's unload (keep_alive 0) while another asks 30 times: every
    request answers, and none sees more than one load of the model while it waits (an
    unload asked for meanwhile waits for it, as Ollama's runner expires once its
    requests are done)."""
    d = serve_models(tmp_path, {"tiny": tiny_path})
    stop = threading.Event()
    unloads = []

    def loop() -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                r = c.post(d.url + "/api/generate", json={"model": "tiny", "keep_alive": 0})
                unloads.append(r.json().get("done_reason"))

    looper = threading.Thread(target=loop)
    looper.start()
    seen = []
    try:
        with httpx.Client(timeout=300) as c:
            for i in range(30):
                before = _loads(d.url, "tiny")
                path, body = (
                    ("/tokenize", {"model": "tiny", "content": "hello"})
                    if i % 2
                    else ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False})
                )
                if i % 2 == 0:
                    body["options"] = {"num_predict": 2}
                r = c.post(d.url + path, json=body)
                assert r.status_code == 200, r.text
                seen.append(_loads(d.url, "tiny") - before)
    finally:
        stop.set()
        looper.join(60)
        d.kill()
    assert max(seen) <= 1, seen
    assert sum(seen) >= 10  # the unloads did run between the requests
    assert "unload" in unloads


WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a text file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}
POEM = [
    {
        "role": "user",
        "content": "Write a four-line poem about the sea into the file poem.txt.",
    }
]


def test_tool_arguments_stream_as_they_are_written_openai(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=300)
    ask = {
        "model": "qwen",
        "messages": POEM,
        "tools": [WRITE_FILE],
        "tool_choice": {"type": "function", "function": {"name": "write_file"}},
        "temperature": 0,
        "max_tokens": 64,  # greedy, the poem goes on to any limit: the call is cut
    }
    whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    (call,) = whole.choices[0].message.tool_calls
    pieces, names, ids = [], [], set()
    for chunk in client.chat.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert delta.index == 0
            if delta.id:
                ids.add(delta.id)
            if delta.function and delta.function.name:
                names.append(delta.function.name)
            if delta.function and delta.function.arguments:
                pieces.append(delta.function.arguments)
    assert names == ["write_file"]  # the name first, once
    assert len(ids) == 1
    assert len(pieces) >= 5
    # the pieces join into the arguments, closed though max_tokens cut the call, as the
    # whole answer's are. Not compared token for token: the second request reuses the
    # first's cells and shares the cache with them, and no kernel layout keeps a row's
    # rounding then (bench/NOTEBOOK.md, "Batch invariance"); a near tie may flip.
    streamed, answered = json.loads("".join(pieces)), json.loads(call.function.arguments)
    assert sorted(streamed) == sorted(answered) == ["content", "path"], pieces
    assert streamed["path"] == answered["path"] == "poem.txt"
    assert streamed["content"].split()[:3] == answered["content"].split()[:3]


def test_tool_arguments_stream_as_they_are_written_anthropic(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="none", max_retries=0, timeout=300)
    tool = {
        "name": "write_file",
        "description": "Write a text file",
        "input_schema": WRITE_FILE["function"]["parameters"],  # type: ignore[index]
    }
    ask = {
        "model": "qwen",
        "max_tokens": 400,
        "messages": POEM,
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "write_file"},
    }
    pieces = []
    with client.messages.stream(**ask) as stream:  # type: ignore[arg-type]
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    (block,) = [b for b in final.content if b.type == "tool_use"]
    assert block.name == "write_file"
    assert len(pieces) >= 5
    assert json.loads("".join(pieces)) == block.input


def test_tool_arguments_stream_as_they_are_written_responses(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=300)
    fn = WRITE_FILE["function"]
    tool = {"type": "function", "name": fn["name"], "parameters": fn["parameters"]}  # type: ignore[index]
    pieces, done = [], []
    stream = client.responses.create(
        model="qwen",
        input=POEM[0]["content"],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "write_file"},
        max_output_tokens=64,
        temperature=0,
        stream=True,
    )
    for event in stream:
        if event.type == "response.function_call_arguments.delta":
            pieces.append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done.append(event.arguments)
    assert len(pieces) >= 5
    assert done == ["".join(pieces)]
    assert isinstance(json.loads(done[0]), dict)


def test_an_anthropic_prefill_is_continued(daemon: Daemon) -> None:
    """Anthropic's prefill: a final assistant message is where the answer goes on from,
    as OpenAI's continue_final_message does."""
    ask = [{"role": "user", "content": "Count from 1 to 30, separated by spaces."}]
    started = [*ask, {"role": "assistant", "content": "1 2 3 4 5 6"}]
    sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
    expected = (
        sdk.chat.completions.create(
            model="qwen",
            messages=started,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"continue_final_message": True},
        )
        .choices[0]
        .message.content
    )
    client = anthropic.Anthropic(base_url=daemon.url, api_key="none", max_retries=0, timeout=120)
    message = client.messages.create(
        model="qwen",
        max_tokens=8,
        messages=started,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )
    (block,) = message.content
    assert block.type == "text"
    assert block.text == expected
    assert block.text.lstrip().startswith("7")
