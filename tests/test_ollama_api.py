"""Ollama's generation API through the official ollama SDK (sync and async) against
`barrel serve`, on the real Qwen model and the tiny one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

from barrel.engine.model import LlamaModel, ModelOptions
from tests.daemon import Daemon, serve_models
from tests.tools import WEATHER

pytestmark = pytest.mark.real_model

GREEDY = {"temperature": 0, "num_predict": 48}


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = serve_models(
        tmp_path_factory.mktemp("ollama-api"),
        {"qwen": qwen_path, "tiny": tiny_path},
        "[models.defaults]\nnum_seq_max = 2",
    )
    yield d
    d.kill()


@pytest.fixture(scope="module")
def vocab(qwen_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(qwen_path, ModelOptions(vocab_only=True))
    yield m
    m.free()


@pytest.fixture
def client(daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_chat_without_streaming(client: ollama.Client) -> None:
    r = client.chat(model="qwen", messages=QUESTION, options=GREEDY)
    assert "Paris" in r.message.content
    assert r.message.role == "assistant"
    assert r.done is True
    assert r.done_reason == "stop"
    assert r.eval_count
    assert r.prompt_eval_count
    assert r.prompt_eval_count > 10
    assert r.total_duration >= r.eval_duration > 0
    assert r.load_duration is not None


def test_chat_streaming_counts_what_it_streams(client: ollama.Client, vocab: LlamaModel) -> None:
    chunks = list(client.chat(model="qwen", messages=QUESTION, options=GREEDY, stream=True))
    final = chunks[-1]
    assert final.done is True
    assert all(not c.done for c in chunks[:-1])
    text = "".join(c.message.content for c in chunks)
    assert "Paris" in text
    assert len(chunks) > 3, "tokens arrive as they are generated"
    # eval_count is every generated token: the text's, plus the end-of-turn token
    assert final.eval_count == len(vocab.tokenize(text, add_special=False)) + 1


def test_generate_streaming_and_not(client: ollama.Client) -> None:
    r = client.generate(
        model="qwen", prompt="What is the capital of France? One word.", options=GREEDY
    )
    assert "Paris" in r.response
    assert r.context
    assert all(isinstance(t, int) for t in r.context)
    chunks = list(
        client.generate(
            model="qwen",
            prompt="What is the capital of France? One word.",
            options=GREEDY,
            stream=True,
        )
    )
    assert "".join(c.response for c in chunks) == r.response
    assert chunks[-1].done_reason == "stop"
    raw = client.generate(
        model="qwen",
        prompt="The capital of France is",
        raw=True,
        options={"temperature": 0, "num_predict": 4},
    )
    assert "Paris" in raw.response
    assert raw.done_reason == "length"
    assert raw.eval_count == 4
    # the whole sequence comes back, as for a templated prompt
    assert len(raw.context) == raw.prompt_eval_count + raw.eval_count


def test_format_schema_output_validates(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
        "required": ["capital", "country"],
    }
    r = client.chat(
        model="qwen",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 64},
    )
    data = json.loads(r.message.content)
    jsonschema.validate(data, schema)
    assert data["capital"] == "Paris"


def test_tools_give_tool_calls(client: ollama.Client) -> None:
    r = client.chat(
        model="qwen",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 96},
    )
    assert r.message.tool_calls
    call = r.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert call.function.arguments["city"] == "Paris"


def test_generate_context_holds_the_answer_and_continues_the_conversation(
    client: ollama.Client, vocab: LlamaModel
) -> None:
    first = client.generate(
        model="qwen", prompt="Pick a colour and say only its name.", options=GREEDY
    )
    context = list(first.context or [])
    # the prompt and the answer (its end-of-turn token left out), as Ollama returns it
    assert len(context) == first.prompt_eval_count + first.eval_count - 1
    answer = vocab.detokenize(context[first.prompt_eval_count :])
    assert answer.strip() == first.response.strip()
    # sent back, the next turn sees the answer: the model can repeat it
    second = client.generate(
        model="qwen",
        prompt="Which colour did you pick? Say only its name.",
        context=context,
        options=GREEDY,
    )
    assert first.response.strip().lower().rstrip(".") in second.response.lower()
    assert second.prompt_eval_count > len(context)


def test_preload_and_unload_show_in_ps(client: ollama.Client) -> None:
    r = client.generate(model="tiny", prompt="", keep_alive="1m")
    assert (r.done, r.done_reason) == (True, "load")
    assert "tiny" in {m.model for m in client.ps().models}
    r = client.generate(model="tiny", prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    assert "tiny" not in {m.model for m in client.ps().models}


def test_embed_a_batch(client: ollama.Client) -> None:
    r = client.embed(model="tiny", input=["hello world", "goodbye moon", "hello world"])
    assert len(r.embeddings) == 3
    assert all(len(v) == 64 for v in r.embeddings)
    assert r.embeddings[0] == pytest.approx(r.embeddings[2], abs=1e-5)
    assert abs(sum(x * x for x in r.embeddings[1]) - 1) < 1e-4
    short = client.embed(model="tiny", input="hello", dimensions=16)
    assert len(short.embeddings[0]) == 16
    legacy = client.embeddings(model="tiny", prompt="hello world")
    assert len(legacy.embedding) == 64


async def test_async_client(daemon: Daemon) -> None:
    client = ollama.AsyncClient(host=daemon.url, timeout=120)
    r = await client.chat(model="qwen", messages=QUESTION, options=GREEDY)
    assert "Paris" in r.message.content
    parts = [
        c
        async for c in await client.chat(
            model="qwen", messages=QUESTION, options=GREEDY, stream=True
        )
    ]
    assert "".join(p.message.content for p in parts) == r.message.content
    both = await asyncio.gather(
        client.generate(model="tiny", prompt="one", options={"num_predict": 5}),
        client.generate(model="tiny", prompt="two", options={"num_predict": 5}),
    )
    assert [b.eval_count for b in both] == [5, 5]


def test_errors_and_probes(client: ollama.Client, daemon: Daemon) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=QUESTION)
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="qwen", messages=QUESTION, keep_alive="soon")
    assert info.value.status_code == 400
    with urllib.request.urlopen(daemon.url + "/", timeout=10) as resp:
        assert resp.read() == b"Ollama is running"
    head = urllib.request.Request(daemon.url + "/", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as resp:
        assert resp.status == 200
    assert client.show("qwen").capabilities
    assert "tools" in client.show("qwen").capabilities


def test_logprobs_when_asked(client: ollama.Client) -> None:
    r = client.generate(
        model="qwen",
        prompt="What is the capital of France? One word.",
        options={"temperature": 0, "num_predict": 6},
        logprobs=True,
        top_logprobs=2,
    )
    assert r.logprobs
    assert "".join(lp.token for lp in r.logprobs).startswith(r.response[:3])
    for lp in r.logprobs:
        assert lp.logprob <= 0
        assert len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].token == lp.token, "greedy takes the most likely token"
    plain = client.generate(model="qwen", prompt="Hi", options={"num_predict": 2})
    assert not plain.logprobs


def test_a_prompt_longer_than_the_context_is_cut_as_ollama_cuts_it(daemon: Daemon) -> None:
    """Ollama keeps the first tokens and the end of a prompt that does not fit, and
    answers; it does not refuse it."""
    client = ollama.Client(host=daemon.url)
    long = "word " * 3000
    r = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": long + "\nthe end"}],
        options={"num_predict": 8, "temperature": 0},
    )
    assert r.done
    assert r.prompt_eval_count is not None
    assert 1000 < r.prompt_eval_count <= 2048 - 8


def test_a_call_cut_by_num_predict_is_a_tool_call_that_says_length(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url)
    r = client.chat(
        model="qwen",
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 14},
    )
    assert r.done_reason == "length"
    (call,) = r.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, dict)


def test_the_weather_prompt_is_a_tool_call_at_temperature_0_8(daemon: Daemon) -> None:
    """Sampled answers come as a tool call in whatever form the model writes it. Which
    path a seed takes depends on the CPU kernels' rounding (flash attention or not):
    with a KV stream per sequence seed 1 of 16 wrote an XML "response" of its own and no
    call, with the shared cache none did; so the test counts."""
    client = ollama.Client(host=daemon.url)
    answers = [
        client.chat(
            model="qwen",
            messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
            tools=[WEATHER],
            options={"temperature": 0.8, "seed": seed, "num_predict": 96},
        ).message
        for seed in range(1, 7)  # seeds 1-6, as in the OpenAI and Anthropic tests
    ]
    calls = [[c.function.name for c in m.tool_calls or []] for m in answers]
    missed = [m for m, c in zip(answers, calls, strict=True) if c != ["get_weather"]]
    assert len(missed) <= 1, missed


def _loads(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(r'^barrel_model_loads_total\{model="qwen"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _unload(how: str, url: str) -> None:
    if how == "http":
        r = httpx.post(url + "/api/generate", json={"model": "qwen", "keep_alive": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["done_reason"] == "unload"
    elif how == "sdk":
        assert (
            ollama.Client(host=url, timeout=60).generate("qwen", keep_alive=0).done_reason
            == "unload"
        )
    else:
        env = {**os.environ, "BARREL_HOST": url}
        cli = [sys.executable, "-m", "barrel", "stop", "qwen"]
        out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert "stopping 'qwen'" in out.stdout, out.stdout


@pytest.mark.parametrize("how", ["http", "sdk", "cli"])
def test_an_unload_answers_at_once_while_clients_chat_and_the_model_loads_again(
    daemon: Daemon, how: str
) -> None:
    """Three clients loop short chats on Qwen and a fourth holds a long stream: an
    unload (Ollama's keep_alive 0, the SDK's, `barrel stop`) answers while that stream
    still runs, /api/ps says the model drains, the model unloads once the requests in
    flight end, and the chats that came meanwhile load it again. No request fails."""
    url = daemon.url
    stop = threading.Event()
    answered = [0, 0, 0]
    errors: list[BaseException] = []
    changed = threading.Condition()

    def chatter(i: int) -> None:
        c = ollama.Client(host=url, timeout=300)
        while not stop.is_set():
            try:
                r = c.chat(
                    model="qwen",
                    messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                    options={"num_predict": 8, "temperature": 0},
                )
                assert r.done
            except BaseException as exc:  # noqa: BLE001 - every failure is the test's
                errors.append(exc)
                return
            with changed:
                answered[i] += 1
                changed.notify_all()

    def each_answered(more_than: list[int]) -> None:
        with changed:  # the wait's timeout is a safety net, not a bound
            got = changed.wait_for(
                lambda: errors or all(a > b for a, b in zip(answered, more_than, strict=True)),
                timeout=600,
            )
        assert not errors, errors
        assert got, answered

    held = {**{"model": "qwen", "stream": True}, "messages": QUESTION}
    held["options"] = {"num_predict": 4000, "temperature": 0}
    chatters = [threading.Thread(target=chatter, args=(i,)) for i in range(3)]
    try:
        with httpx.stream("POST", url + "/api/chat", json=held, timeout=300) as stream:
            assert json.loads(next(stream.iter_lines()))["done"] is False
            loads = _loads(url)  # the model is loaded: it answers the held stream
            for t in chatters:
                t.start()
            each_answered([0, 0, 0])
            _unload(how, url)  # answered while the held stream runs
            ps = httpx.get(url + "/api/ps", timeout=30).json()["models"]
            [qwen] = [m for m in ps if m["name"].startswith("qwen")]
            assert qwen["state"] == "draining"
            assert qwen["expires_at"] is not None
            status = httpx.get(url + "/api/status", timeout=30).json()["models"]
            assert [m["state"] for m in status if m["name"].startswith("qwen")] == ["draining"]
            before = list(answered)
        # the held stream ends (its client left): the model unloads when the chats in
        # flight end, and the chats that came meanwhile load it again and are answered
        each_answered(before)
    finally:
        stop.set()
        for t in chatters:
            if t.is_alive():
                t.join(300)
    assert errors == []
    assert _loads(url) == loads + 1  # one load after the unload, whatever waited for it
