"""OpenAI's API through the official openai SDK (sync and async) against `barrel serve`,
on the real Qwen model and the tiny one."""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from pydantic import BaseModel

from tests.daemon import Daemon, serve_models
from tests.tools import SHORT, WEATHER

pytestmark = pytest.mark.real_model

QUESTION: Any = [{"role": "user", "content": "What is the capital of France?"}]
# Qwen 0.5B at greedy, without a repeat penalty (OpenAI's default), answers a tool's
# result by calling the tool again; llama-server's repeat_penalty lets it answer.
UNSTUCK = {"repeat_penalty": 1.1}
# greedy, Qwen counts for hundreds of tokens: a request that holds its slot for long
COUNT: Any = [
    {"role": "user", "content": "Write the numbers from 1 to 200 in words, one per line."}
]


def _daemon(tmp: Path, qwen_path: Path, tiny_path: Path, extra: str = "") -> Daemon:
    return serve_models(
        tmp,
        {"qwen": qwen_path, "tiny": tiny_path},
        f'import_dir = "{qwen_path.parent}"\n'
        'aliases = { coder = "qwen", ghost = "not-there" }\n' + extra,
    )


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = _daemon(
        tmp_path_factory.mktemp("openai-api"),
        qwen_path,
        tiny_path,
        "[models.defaults]\nnum_seq_max = 2\n[limits]\nmax_messages = 6\nmax_tools = 2\n"
        "max_embedding_inputs = 3\n",
    )
    yield d
    d.kill()


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture
def aclient(daemon: Daemon) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=daemon.url + "/v1", api_key="unused", timeout=120, max_retries=0
    )


# -- chat completions -----------------------------------------------------------------------


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="qwen", messages=QUESTION, temperature=0, max_tokens=40
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "qwen"
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    assert r.usage is not None
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 40
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_stream_answers_paris_async(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model="qwen",
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert finishes.count("stop") == 1
    # include_usage: usage is null on every chunk but the last, which has no choices
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done_and_no_usage_unless_asked(daemon: Daemon) -> None:
    body = {"model": "qwen", "messages": QUESTION, "max_tokens": 3, "stream": True}
    raw = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    decoded = [json.loads(f) for f in frames[:-1]]
    assert all("usage" not in f for f in decoded)
    assert decoded[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_tool_call_auto_on_qwen_is_assembled(client: openai.OpenAI) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    with client.chat.completions.stream(
        model="qwen", messages=ask, tools=[WEATHER], tool_choice="auto", temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert call.id
    # the tool's answer goes back as a tool message and the model uses it
    follow: Any = [
        *ask,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"},
    ]
    answer = client.chat.completions.create(
        model="qwen",
        messages=follow,
        tools=[WEATHER],
        temperature=0,
        max_tokens=60,
        extra_body=UNSTUCK,
    )
    # the tool's result reaches the model; Qwen 0.5B may repeat its call before it
    assert "22" in (answer.choices[0].message.content or ""), answer.choices[0].message


async def test_streamed_tool_call_required_on_tiny(aclient: openai.AsyncOpenAI) -> None:
    async with aclient.chat.completions.stream(
        model="tiny",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[SHORT],
        tool_choice="required",
        max_tokens=200,
    ) as stream:
        deltas = [e async for e in stream if e.type == "chunk"]
        final = await stream.get_final_completion()
    with_calls = [e for e in deltas if e.chunk.choices and e.chunk.choices[0].delta.tool_calls]
    assert with_calls  # the call arrived as tool_calls deltas
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    assert len(args["city"]) <= 12  # the grammar keeps to the schema
    assert final.choices[0].finish_reason == "tool_calls"


class Capital(BaseModel):
    country: str
    capital: str


def test_json_schema_parsed_by_the_sdk(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="qwen",
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=60,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital)
    assert parsed.capital == "Paris"


def test_second_turn_reports_cached_tokens(client: openai.OpenAI) -> None:
    turn: Any = [
        {"role": "system", "content": "You are a terse geography tutor."},
        {"role": "user", "content": "What is the capital of Spain?"},
    ]
    first = client.chat.completions.create(
        model="qwen", messages=turn, temperature=0, max_tokens=30
    )
    assert first.usage is not None
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Germany?"},
    ]
    second = client.chat.completions.create(
        model="qwen", messages=turn, temperature=0, max_tokens=30
    )
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens is not None
    # the whole first turn (prompt and answer, less its last token) was in the KV cache
    assert details.cached_tokens >= first.usage.prompt_tokens
    assert "Berlin" in (second.choices[0].message.content or "")


def test_n_choices_logprobs_stop_and_penalties(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="qwen",
        messages=QUESTION,
        n=2,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.1,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy
    lps = r.choices[0].logprobs
    assert lps is not None
    assert lps.content
    first = lps.content[0]
    assert first.logprob <= 0
    assert len(first.top_logprobs) == 3
    assert first.bytes == list(first.token.encode())
    assert r.usage is not None
    assert r.usage.completion_tokens == sum(
        len((c.logprobs and c.logprobs.content) or []) for c in r.choices
    )
    stopped = client.chat.completions.create(
        model="qwen", messages=QUESTION, temperature=0, max_tokens=40, stop=["Paris"]
    )
    assert "Paris" not in (stopped.choices[0].message.content or "")
    assert stopped.choices[0].finish_reason == "stop"


def test_logit_bias_bans_a_token(client: openai.OpenAI, daemon: Daemon) -> None:
    ids = httpx.post(
        daemon.url + "/tokenize", json={"model": "qwen", "content": " Paris"}, timeout=60
    ).json()["tokens"]
    assert len(ids) == 1
    r = client.chat.completions.create(
        model="qwen",
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        logit_bias={str(ids[0]): -100},
        max_completion_tokens=30,
    )
    assert " Paris" not in (r.choices[0].message.content or "")


def test_developer_role_and_text_parts(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="qwen",
        temperature=0,
        max_tokens=20,
        messages=[
            {"role": "developer", "content": "Answer with the single word: banana."},
            {"role": "user", "content": [{"type": "text", "text": "Say the word."}]},
        ],
    )
    assert "banana" in (r.choices[0].message.content or "").lower()


async def test_reasoning_content_with_a_thinking_template(
    aclient: openai.AsyncOpenAI, daemon: Daemon, qwen_path: Path, llama_templates: Path
) -> None:
    template = (llama_templates / "Qwen-Qwen3-0.6B.jinja").read_text()
    await ollama.AsyncClient(host=daemon.url, timeout=300).create(
        model="qwen-think", from_=str(qwen_path), template=template
    )
    stream = await aclient.chat.completions.create(
        model="qwen-think",
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        reasoning_effort="minimal",  # a 64-token reasoning budget
        stream=True,
    )
    reasoning, content = "", ""
    async for chunk in stream:
        if chunk.choices:
            extra = chunk.choices[0].delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert reasoning.strip()
    assert "<think>" not in content
    assert content.strip()
    # effort "none" turns thinking off: no reasoning at all
    plain = await aclient.chat.completions.create(
        model="qwen-think", messages=QUESTION, temperature=0, max_tokens=30, reasoning_effort="none"
    )
    message = plain.choices[0].message
    assert not (message.model_extra or {}).get("reasoning_content")
    assert "Paris" in (message.content or "")


def test_a_template_that_prints_no_tools_still_gets_a_call(
    client: openai.OpenAI, daemon: Daemon, qwen_path: Path, llama_templates: Path
) -> None:
    template = (llama_templates / "microsoft-Phi-3.5-mini-instruct.jinja").read_text()
    ollama.Client(host=daemon.url, timeout=300).create(
        model="qwen-phi", from_=str(qwen_path), template=template
    )
    r = client.chat.completions.create(
        model="qwen-phi",
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
        tools=[WEATHER],
        temperature=0,
        max_tokens=80,
        stop=["<|end|>"],  # Phi's end of turn is plain text to Qwen's tokenizer
    )
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()


# -- errors ---------------------------------------------------------------------------------


def test_errors_in_openai_envelope(client: openai.OpenAI, daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=QUESTION)
    assert missing.value.status_code == 404
    assert "nope" in missing.value.message
    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model="qwen", messages=QUESTION, temperature=3)
    body: Any = hot.value.body
    assert body["param"] == "temperature"
    assert body["type"] == "invalid_request_error"
    image: Any = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as img:
        client.chat.completions.create(model="qwen", messages=image)
    assert "text only" in img.value.message
    # limits are checked before the model is looked up (an unknown model is not a 404)
    many: Any = [{"role": "user", "content": str(i)} for i in range(7)]
    with pytest.raises(openai.BadRequestError) as limit:
        client.chat.completions.create(model="nope", messages=many)
    assert "at most 6 messages" in limit.value.message
    tools = [WEATHER, SHORT, WEATHER]
    with pytest.raises(openai.BadRequestError, match="at most 2 tools"):
        client.chat.completions.create(model="nope", messages=QUESTION, tools=tools)
    with pytest.raises(openai.BadRequestError) as choice:
        client.chat.completions.create(
            model="nope",
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "other"}},
        )
    assert "other" in choice.value.message
    raw = httpx.post(daemon.url + "/v1/chat/completions", content=b"{nope", timeout=30)
    assert raw.status_code == 400
    assert raw.json()["error"]["type"] == "invalid_request_error"
    big = httpx.post(daemon.url + "/v1/chat/completions", content=b"x" * (2 << 20), timeout=30)
    assert big.status_code == 413
    assert set(big.json()["error"]) == {"message", "type", "param", "code"}


# -- completions, tokenizer -----------------------------------------------------------------


def test_completions_prompt_forms_echo_and_logprobs(client: openai.OpenAI, daemon: Daemon) -> None:
    text = client.completions.create(
        model="qwen", prompt="def fib(n):", max_tokens=12, temperature=0, logprobs=2
    )
    assert text.object == "text_completion"
    (choice,) = text.choices
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert len(choice.logprobs.tokens or []) == 12
    assert "".join(choice.logprobs.tokens or []) == choice.text
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset or [])
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs or [])
    ids = httpx.post(
        daemon.url + "/tokenize",
        json={"model": "qwen", "content": "def fib(n):"},
        timeout=30,
    ).json()["tokens"]
    same = client.completions.create(model="qwen", prompt=ids, max_tokens=12, temperature=0)
    assert same.choices[0].text == choice.text  # token ids are the same prompt
    many = client.completions.create(
        model="qwen",
        prompt=["The capital of France is", [*ids]],
        max_tokens=4,
        temperature=0,
        n=2,
        echo=True,
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text.startswith("The capital of France is")
    assert many.choices[2].text.startswith("def fib(n):")
    assert many.usage is not None
    assert many.usage.prompt_tokens == 5 + len(ids)


def test_completions_score_a_text_with_echo_and_logprobs(client: openai.OpenAI) -> None:
    """Evaluation harnesses score answers this way: echo, logprobs, max_tokens 0."""

    def score(text: str) -> Any:
        r = client.completions.create(
            model="qwen", prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
        )
        (choice,) = r.choices
        assert r.usage is not None
        assert r.usage.completion_tokens == 0
        assert choice.text == text
        lps = choice.logprobs
        assert lps is not None
        assert "".join(lps.tokens or []) == text
        assert len(lps.tokens or []) == r.usage.prompt_tokens
        assert (lps.token_logprobs or [])[0] is None  # nothing before the first token
        assert all(lp <= 0 for lp in (lps.token_logprobs or [])[1:])
        assert (lps.text_offset or [])[0] == 0
        assert lps.text_offset == sorted(lps.text_offset or [])
        return lps

    paris = score("The capital of France is Paris")
    rome = score("The capital of France is Rome")
    assert paris.tokens[-1] == " Paris"
    assert rome.tokens[-1] == " Rome"
    assert paris.token_logprobs[-1] > rome.token_logprobs[-1] + 2  # the model knows
    with pytest.raises(openai.BadRequestError, match="without streaming"):
        client.completions.create(
            model="qwen", prompt="x", echo=True, logprobs=1, max_tokens=0, stream=True
        )


async def test_completions_stream_and_fill_in_the_middle(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.completions.create(
        model="qwen", prompt="1, 2, 3,", max_tokens=6, temperature=0, stream=True
    )
    parts = [c async for c in stream]
    assert "".join(c.choices[0].text for c in parts).startswith(" 4, 5")
    assert parts[-1].choices[0].finish_reason == "length"
    fim = await aclient.completions.create(
        model="qwen",
        prompt="def add(a, b):\n    ",
        suffix="\n\nprint(add(1, 2))\n",
        max_tokens=8,
        temperature=0,
    )
    assert "a + b" in fim.choices[0].text
    # Ollama's suffix builds the same fill-in-the-middle prompt: the same answer from
    # the same prompt tokens (one place builds a prompt without a chat template)
    other = ollama.AsyncClient(host=str(aclient.base_url).removesuffix("/v1/"))
    same = await other.generate(
        model="qwen",
        prompt="def add(a, b):\n    ",
        suffix="\n\nprint(add(1, 2))\n",
        options={"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0},
    )
    assert same.response == fim.choices[0].text
    assert fim.usage is not None
    assert same.prompt_eval_count == fim.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as ids:
        await aclient.completions.create(model="qwen", prompt=[1, 2], suffix="y", max_tokens=2)
    assert "suffix needs the prompt as text" in ids.value.message


def test_tokenize_detokenize_round_trip(daemon: Daemon) -> None:
    tok = httpx.post(
        daemon.url + "/tokenize",
        json={"model": "qwen", "content": "Hello world", "with_pieces": True},
        timeout=30,
    ).json()["tokens"]
    assert [t["piece"] for t in tok] == ["Hello", " world"]
    back = httpx.post(
        daemon.url + "/detokenize",
        json={"model": "qwen", "tokens": [t["id"] for t in tok]},
        timeout=30,
    ).json()
    assert back == {"content": "Hello world"}
    bad = httpx.post(
        daemon.url + "/detokenize", json={"model": "qwen", "tokens": [10**9]}, timeout=30
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"


# -- embeddings, models ---------------------------------------------------------------------


def test_embeddings_shape_and_base64_round_trip(client: openai.OpenAI, daemon: Daemon) -> None:
    # the SDK asks for base64 by default and decodes it
    packed = client.embeddings.create(model="qwen", input=["hello", "world"])
    assert [d.index for d in packed.data] == [0, 1]
    assert len(packed.data[0].embedding) == 896
    plain = client.embeddings.create(
        model="qwen", input=["hello", "world"], encoding_format="float"
    )
    for a, b in zip(packed.data, plain.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert math.isclose(math.fsum(x * x for x in plain.data[0].embedding), 1.0, rel_tol=1e-4)
    raw = httpx.post(
        daemon.url + "/v1/embeddings",
        json={"model": "qwen", "input": "hello", "encoding_format": "base64"},
        timeout=60,
    ).json()
    blob = base64.b64decode(raw["data"][0]["embedding"])
    floats = struct.unpack(f"<{len(blob) // 4}f", blob)
    assert floats == pytest.approx(plain.data[0].embedding, abs=1e-6)
    assert packed.usage.prompt_tokens == 2
    short = client.embeddings.create(model="qwen", input="hello", dimensions=64)
    assert len(short.data[0].embedding) == 64
    assert math.isclose(math.fsum(x * x for x in short.data[0].embedding), 1.0, rel_tol=1e-4)
    ids = httpx.post(
        daemon.url + "/tokenize", json={"model": "qwen", "content": "hello"}, timeout=30
    ).json()["tokens"]
    by_ids = client.embeddings.create(model="qwen", input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(plain.data[0].embedding, abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="1 to 3"):
        client.embeddings.create(model="qwen", input=["a", "b", "c", "d"])


def test_models_list_and_alias(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    assert {"qwen", "tiny", "coder"} <= set(models)
    assert "ghost" not in models  # an alias whose target does not exist
    assert all(m.object == "model" and m.created > 0 for m in models.values())
    alias = client.models.retrieve("coder")
    assert alias.id == "coder"
    assert alias.model_extra is not None
    assert alias.model_extra["root"] == "qwen"
    assert client.models.retrieve("qwen").created == models["qwen"].created
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # and the alias serves requests
    r = client.chat.completions.create(model="coder", messages=QUESTION, max_tokens=3)
    assert r.choices[0].message.content


# -- responses ------------------------------------------------------------------------------


async def test_responses_stream(aclient: openai.AsyncOpenAI) -> None:
    async with aclient.responses.stream(
        model="qwen",
        input="What is the capital of France?",
        instructions="Answer in one sentence.",
        temperature=0,
        max_output_tokens=40,
    ) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "Paris" in deltas
    assert final.output_text == deltas
    assert final.status == "completed"
    assert final.usage is not None
    assert final.usage.output_tokens > 0


def test_responses_continue_with_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="qwen",
        input=[{"role": "user", "content": "What is the capital of Italy?"}],
        temperature=0,
        max_output_tokens=30,
    )
    assert "Rome" in first.output_text
    second = client.responses.create(
        model="qwen",
        input="And of Germany?",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=30,
    )
    assert "Berlin" in second.output_text
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model="qwen", input="x", previous_response_id=first.id)
    body: Any = gone.value.body
    assert body["code"] == "previous_response_not_found"
    assert body["param"] == "previous_response_id"
    unstored = client.responses.create(model="qwen", input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_function_call_round_trip(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", **WEATHER["function"]}
    ask = "What is the weather in Paris right now?"
    first = client.responses.create(model="qwen", input=ask, tools=[tool], temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather"
    assert "paris" in json.loads(call.arguments)["city"].lower()
    second = client.responses.create(
        model="qwen",
        input=[
            {"role": "user", "content": ask},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees"},
        ],
        tools=[tool],
        temperature=0,
        max_output_tokens=60,
        extra_body=UNSTUCK,
    )
    assert "22" in second.output_text


# -- auth -------------------------------------------------------------------------------------


def test_api_keys(tmp_path: Path, tiny_path: Path) -> None:
    d = serve_models(tmp_path, {"tiny": tiny_path}, '[auth]\napi_keys = ["sekrit"]')
    try:
        wrong = openai.OpenAI(base_url=d.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.models.list()
        assert denied.value.status_code == 401
        assert httpx.get(d.url + "/health", timeout=10).status_code == 200
        assert httpx.post(d.url + "/tokenize", json={}, timeout=10).status_code == 401
        right = openai.OpenAI(base_url=d.url + "/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in right.models.list()] == ["tiny"]
    finally:
        d.kill()


# -- a single slot: queue comments, disconnects, errors mid-stream ----------------------------


@pytest.fixture(scope="module")
def solo(
    tmp_path_factory: pytest.TempPathFactory, qwen_path: Path, tiny_path: Path
) -> Iterator[Daemon]:
    d = _daemon(
        tmp_path_factory.mktemp("openai-solo"),
        qwen_path,
        tiny_path,
        "[models.defaults]\nnum_seq_max = 1\nqueue_depth = 2\nqueue_timeout_s = 4",
    )
    yield d
    d.kill()


@contextmanager
def _holding(url: str) -> Iterator[httpx.Response]:
    """A streaming request that takes the only slot for 1,500 tokens (~25 s at 60 tok/s)
    unless its response is closed (the client goes away)."""
    # end-of-turn tokens banned: the count goes on for all its tokens
    no_end = {"151643": -100, "151645": -100}
    body = {
        "model": "qwen",
        "messages": COUNT,
        "temperature": 0,
        "max_tokens": 1500,
        "logit_bias": no_end,
    }
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        assert '"content"' in next(line for line in lines if line.startswith("data: "))
        yield r


def test_a_disconnect_frees_the_slot_for_a_waiting_request(solo: Daemon) -> None:
    body = {"model": "qwen", "messages": QUESTION, "temperature": 0, "max_tokens": 20}
    with (
        _holding(solo.url) as holder,
        httpx.stream(
            "POST", solo.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as waiting,
    ):
        lines = waiting.iter_lines()
        first = next(line for line in lines if line)
        assert first == ": queued, position 1"  # an SSE comment while it waits
        holder.close()  # the client goes away mid-stream
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    frames = [json.loads(f[6:]) for f in rest[:-1]]
    # an answer, not the queue timeout (4 s): the 1,500-token request did not run to its end
    assert "Paris" in "".join(f["choices"][0]["delta"].get("content") or "" for f in frames)


def test_a_failure_mid_stream_sends_an_error_frame(solo: Daemon) -> None:
    body = {"model": "qwen", "messages": QUESTION, "max_tokens": 4}
    with _holding(solo.url), ThreadPoolExecutor(2) as pool:

        def through_the_sdk() -> openai.APIError:
            sdk = openai.OpenAI(base_url=solo.url + "/v1", api_key="k", timeout=60, max_retries=0)
            stream = sdk.chat.completions.create(**body, stream=True)  # type: ignore[call-overload]
            with pytest.raises(openai.APIError) as failed:
                list(stream)  # queued, then the queue timeout after the stream began
            return failed.value

        # both wait in the queue (its depth is 2) at once
        sdk_error = pool.submit(through_the_sdk)
        raw = pool.submit(
            httpx.post, solo.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        )
        assert "queue" in sdk_error.result().message
        lines = [line for line in raw.result().text.splitlines() if line]
        assert lines[0] in (": queued, position 1", ": queued, position 2"), lines
        error = json.loads(lines[-1][6:])["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "unavailable"
        assert "[DONE]" not in raw.result().text
        # without streaming, the same wait is a plain 503 that says when to come back
        plain = httpx.post(solo.url + "/v1/chat/completions", json=body, timeout=60)
        assert plain.status_code == 503
        assert int(plain.headers["retry-after"]) >= 1
        assert plain.json()["error"]["code"] == "unavailable"


def test_tokenizing_does_not_wait_behind_generation(solo: Daemon) -> None:
    with _holding(solo.url):  # the only slot is taken
        tok = httpx.post(
            solo.url + "/tokenize", json={"model": "qwen", "content": "Hello"}, timeout=30
        )
        counted = httpx.post(
            solo.url + "/v1/messages/count_tokens",
            json={"model": "qwen", "messages": QUESTION},
            timeout=30,
        )
    # queued behind the holder, both would have ended in the queue timeout's 503
    assert tok.status_code == 200
    assert tok.json()["tokens"] == [9707]
    assert counted.status_code == 200
    assert counted.json()["input_tokens"] > 10


def test_leaving_a_stream_of_two_choices_frees_both_sequences(daemon: Daemon) -> None:
    body = {
        "model": "qwen",
        "messages": COUNT,
        "temperature": 0,
        "max_tokens": 600,
        "n": 2,
        "stream": True,
    }

    def qwen_status() -> Any:
        status = httpx.get(daemon.url + "/api/status", timeout=10).json()
        return next(m for m in status["models"] if m["name"] == "qwen")

    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        seen: set[int] = set()
        for line in lines:
            if line.startswith("data: {") and '"content":"' in line:
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == {0, 1}:
                break
        assert qwen_status()["active_sequences"] == 2  # both choices generate
    # the client left: both sequences end within a step or two, not after 600 tokens
    deadline = time.monotonic() + 5
    while (s := qwen_status())["active_sequences"] or s["running"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_a_prompt_longer_than_the_context_is_openais_context_length_error(
    client: openai.OpenAI,
) -> None:
    long: Any = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
    body: Any = too_long.value.body
    assert body["code"] == "context_length_exceeded"
    # the wording OpenAI uses, which clients (litellm, langchain-openai) look for
    assert "Input tokens exceed the configured limit of 2048 tokens" in body["message"]
    assert "Your messages resulted in 30" in body["message"]


def test_a_forced_call_cut_by_max_tokens_is_a_call_that_says_length(
    client: openai.OpenAI,
) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=14,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)  # closed where it was cut
    assert choice.message.content is None


@pytest.mark.parametrize("seed", range(1, 7))
def test_the_weather_prompt_is_a_call_at_temperature_0_8(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
        tools=[WEATHER],
        temperature=0.8,
        seed=seed,
        max_tokens=96,
    )
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], r.choices[0].message.content


IM_END = 151645  # Qwen's end-of-turn token, an end-of-generation token of both models


def test_ignore_eos_generates_past_the_end_of_turn(client: openai.OpenAI) -> None:
    """vLLM's and llama-server's `ignore_eos` (benchmarks such as GuideLLM send it to get
    answers of the length they ask for): with the end-of-turn token made certain, the
    answer stops at once without it and runs to max_tokens with it."""
    forced = {"logit_bias": {str(IM_END): 100}}
    ended = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=6, extra_body=forced
    )
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage is not None
    assert ended.usage.completion_tokens <= 1
    kept = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=6, extra_body={**forced, "ignore_eos": True}
    )
    assert kept.choices[0].finish_reason == "length"
    assert kept.usage is not None
    assert kept.usage.completion_tokens == 6
    text = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=5, extra_body={**forced, "ignore_eos": True}
    )
    assert text.choices[0].finish_reason == "length"
    assert text.usage is not None
    assert text.usage.completion_tokens == 5
