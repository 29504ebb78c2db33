"""A Python client generated from openapi.yaml by openapi-python-client talks to a live
daemon: it lists the models, chats (OpenAI and Ollama), and reads streamed answers with
its own models (generators have no NDJSON or SSE reader: the stream is read line by line
and each line parsed by the generated classes)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.contract.live import SPEC, Live
from tests.contract.spec import sse_data


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("generated")
    config = root / "config.yaml"
    config.write_text("package_name_override: barrel_client\npost_hooks: []\n")
    out = root / "barrel_client"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "openapi_python_client",
            "generate",
            "--path",
            str(SPEC),
            "--config",
            str(config),
            "--meta",
            "none",
            "--output-path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # every schema became a class: nothing was left out of the client
    assert "Warning" not in run.stdout + run.stderr, run.stdout + run.stderr
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("barrel_client")
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m.startswith("barrel_client")]:
            del sys.modules[name]


def test_the_generated_client_lists_models_and_chats(live: Live, generated: Any) -> None:
    from barrel_client.api.ollama import chat
    from barrel_client.api.openai import create_chat_completion, list_models
    from barrel_client.models import ChatCompletion, ChatCompletionRequest, ChatDone, ChatRequest

    client = generated.Client(base_url=live.url, raise_on_unexpected_status=True, timeout=60)
    listed = list_models.sync(client=client)
    assert listed is not None
    assert {m.id for m in listed.data} >= {"tiny", "tiny-rerank"}

    body = ChatCompletionRequest.from_dict(
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
    )
    answer = create_chat_completion.sync(client=client, body=body)
    assert isinstance(answer, ChatCompletion)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5

    asked = ChatRequest.from_dict(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": False,
            "options": {"num_predict": 3},
        }
    )
    done = chat.sync(client=client, body=asked)
    assert isinstance(done, ChatDone)
    assert done.eval_count == 3
    assert done.done_reason == "length"


def test_the_generated_client_reads_streamed_answers(live: Live, generated: Any) -> None:
    from barrel_client.api.ollama import chat
    from barrel_client.api.openai import create_chat_completion
    from barrel_client.models import (
        ChatCompletionChunk,
        ChatCompletionRequest,
        ChatDone,
        ChatPiece,
        ChatRequest,
    )

    client = generated.Client(base_url=live.url, timeout=60)
    body = ChatCompletionRequest.from_dict(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    # the generated request, sent as a stream
    with client.get_httpx_client().stream(**create_chat_completion._get_kwargs(body=body)) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [data for _, data in sse_data(text)]
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.from_dict(json.loads(e)) for e in events[:-1]]
    text_out = "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].delta.content
    )
    assert text_out
    assert chunks[-1].usage.completion_tokens == 6

    asked = ChatRequest.from_dict(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "options": {"num_predict": 4},
        }
    )
    with client.get_httpx_client().stream(**chat._get_kwargs(body=asked)) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    pieces = [ChatPiece.from_dict(line) for line in lines[:-1]]
    last = ChatDone.from_dict(lines[-1])
    # a piece per token, except where a token ends mid-character or could start a stop
    # string: its text rides with the next piece (the sampled tokens are not seeded); a
    # character the last token leaves unfinished is sent on its own, as U+FFFD
    assert last.eval_count == 4
    unfinished = bool(pieces) and set(pieces[-1].message.content) == {"\ufffd"}
    assert 1 <= len(pieces) <= 4 + int(unfinished)
    assert "".join(p.message.content for p in pieces) != ""
