"""Audio in: the tiny model with a synthetic Whisper-style projector
(barrel.store.synthetic.tiny_audio_projector), through the official openai SDK. A clip's
tokens are in the usage, a second turn about the same clip reuses its cells, the
transcription route answers in each response format and streamed, and hostile clips are
a 400 before any decode while the daemon serves on."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, EngineRequest
from barrel.store.synthetic import tiny_audio_projector, tiny_projector
from tests.daemon import Daemon, serve_models
from tests.sounds import flac, flac_bomb, tone_wav, wav_declaring

WINDOW_TOKENS = 750  # a 30-second window: 3,000 mel frames, halved by the conv, pooled


@pytest.fixture(scope="module")
def hearing() -> Path:
    return tiny_audio_projector()


def _part(clip: bytes, fmt: str = "wav") -> dict[str, object]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(clip).decode(), "format": fmt},
    }


# -- the engine ---------------------------------------------------------------------


async def test_a_long_clip_is_several_windows_each_evaluated(
    tiny_path: Path, hearing: Path
) -> None:
    model = LlamaModel.load(tiny_path)
    e = Engine(model, EngineOptions(n_ctx=4096, n_seq_max=1, mmproj=hearing)).start()
    try:
        assert e.projector is not None
        assert e.projector.reads_audio
        assert not e.projector.reads_images
        short, long = tone_wav(1.0), tone_wav(45.0)
        pieces = e.projector.read({hashlib.sha256(c).hexdigest(): c for c in (short, long)})
        one, two = pieces.values()
        assert [m.n_pos for m in one.media] == [WINDOW_TOKENS]
        assert [m.n_pos for m in two.media] == [WINDOW_TOKENS, WINDOW_TOKENS]
        assert len({m.token for m in (*one.media, *two.media)}) == 3  # a placeholder each
        head = model.tokenize("<|im_start|>user\n")
        tail = model.tokenize("What?<|im_end|>\n<|im_start|>assistant\n", add_special=False)
        prompt = [*head, *two.tokens(), *tail]
        request = EngineRequest(prompt, GREEDY, max_tokens=4, media=two.media)
        _, done = await e.submit(request).collect()
        assert done.usage.prompt_tokens == len(prompt)
        # the same clip again: both windows come from the KV cache
        _, again = await e.submit(request).collect()
        assert again.usage.prompt_reused >= len(prompt) - len(tail)
        assert again.tokens == done.tokens
    finally:
        await asyncio.to_thread(e.stop)
        model.free()


# -- the daemon ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, tiny_path: Path, hearing: Path
) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("audio-daemon")
    config = (
        f'projectors = {{ "tiny-audio" = "{hearing}", "tiny-vision" = "{tiny_projector()}" }}\n'
    )
    models = {"tiny": tiny_path, "tiny-audio": tiny_path, "tiny-vision": tiny_path}
    d = serve_models(tmp, models, config=config, context=4096)
    try:
        yield d
    finally:
        d.kill()


def _openai(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _chat(
    client: openai.OpenAI,
    content: object,
    history: list[dict[str, object]] | None = None,
    model: str = "tiny-audio",
) -> object:
    return client.chat.completions.create(
        model=model,
        messages=[*(history or []), {"role": "user", "content": content}],  # type: ignore[list-item]
        temperature=0,
        max_tokens=6,
    )


def test_show_lists_audio_only_with_an_audio_projector(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url, timeout=60)
    caps = client.show("tiny-audio").capabilities or []
    assert "audio" in caps
    assert "vision" not in caps
    assert "audio" not in (client.show("tiny-vision").capabilities or [])
    assert "audio" not in (client.show("tiny").capabilities or [])


def test_chat_with_input_audio_then_a_second_turn(daemon: Daemon) -> None:
    client = _openai(daemon)
    question = {"type": "text", "text": "What do you hear?"}
    plain = _chat(client, [question])
    first = _chat(client, [_part(tone_wav(1.0)), question])
    # the clip's window, between the projector's begin and end markers
    added = first.usage.prompt_tokens - plain.usage.prompt_tokens  # type: ignore[attr-defined]
    assert WINDOW_TOKENS <= added <= WINDOW_TOKENS + 32
    other = _chat(client, [_part(tone_wav(1.0, hz=1500.0)), question])
    assert other.choices[0].message.content != first.choices[0].message.content  # type: ignore[attr-defined]
    history = [
        {"role": "user", "content": [_part(tone_wav(1.0)), question]},
        {"role": "assistant", "content": first.choices[0].message.content},  # type: ignore[attr-defined]
    ]
    second = _chat(client, "And now?", history)
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]
    assert cached >= first.usage.prompt_tokens  # type: ignore[attr-defined]
    # a FLAC of the same tone is the same samples: the same answer
    same = _chat(client, [_part(flac(1.0), "flac"), question])
    assert same.choices[0].message.content == first.choices[0].message.content  # type: ignore[attr-defined]


def test_responses_take_an_input_audio_part(daemon: Daemon) -> None:
    client = _openai(daemon)
    content = [_part(tone_wav(1.0)), {"type": "input_text", "text": "Describe it."}]
    r = client.responses.create(
        model="tiny-audio",
        input=[{"role": "user", "content": content}],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    plain = client.responses.create(
        model="tiny-audio", input="Describe it.", max_output_tokens=4, temperature=0
    )
    assert r.usage is not None
    assert plain.usage is not None
    assert r.usage.input_tokens >= plain.usage.input_tokens + WINDOW_TOKENS


def test_transcriptions_in_every_format_and_streamed(daemon: Daemon) -> None:
    client = _openai(daemon)
    clip = tone_wav(1.5)

    def create(**kwargs: object) -> object:
        # 16 tokens: the tiny model never ends an answer itself, and each of these would
        # otherwise generate to the end of the context (~50 s of the suite, 300 on a
        # loaded box)
        return client.audio.transcriptions.create(
            model="tiny-audio",
            file=("tone.wav", clip),
            temperature=0,
            extra_body={"max_tokens": 16},
            **kwargs,  # type: ignore[arg-type]
        )

    as_json = create()
    text = as_json.text  # type: ignore[attr-defined]
    assert text
    assert as_json.usage.input_tokens > WINDOW_TOKENS  # type: ignore[attr-defined]
    assert create(response_format="text").strip() == text  # type: ignore[attr-defined]
    verbose = create(response_format="verbose_json")
    assert verbose.text == text  # type: ignore[attr-defined]
    assert verbose.duration == pytest.approx(1.5)  # type: ignore[attr-defined]
    # the language joins the instruction (and so changes what the model reads)
    english = create(language="en")
    assert english.usage.input_tokens > as_json.usage.input_tokens  # type: ignore[attr-defined]
    assert create(response_format="verbose_json", language="en").language == "en"  # type: ignore[attr-defined]
    assert verbose.segments[0].end == pytest.approx(1.5)  # type: ignore[attr-defined]
    srt = create(response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,500\n")  # type: ignore[attr-defined]
    assert text in srt  # type: ignore[operator]
    vtt = create(response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n")  # type: ignore[attr-defined]

    deltas: list[str] = []
    done = None
    for event in create(stream=True):  # type: ignore[attr-defined]
        if event.type == "transcript.text.delta":
            deltas.append(event.delta)
        elif event.type == "transcript.text.done":
            done = event
    assert done is not None
    assert "".join(deltas).strip() == done.text == text
    assert done.usage is not None
    assert done.usage.input_tokens == as_json.usage.input_tokens

    translated = client.audio.translations.create(
        model="tiny-audio", file=("tone.wav", clip), extra_body={"max_tokens": 8}
    )
    assert isinstance(translated.text, str)
    assert translated.text


def test_four_clips_at_once_answer_as_each_alone(daemon: Daemon) -> None:
    client = _openai(daemon)
    clips = [tone_wav(1.0, hz=hz) for hz in (300.0, 600.0, 1200.0, 2400.0)]

    def ask(clip: bytes) -> str:
        r = _chat(client, [_part(clip), {"type": "text", "text": "What is it?"}])
        return r.choices[0].message.content or ""  # type: ignore[attr-defined]

    alone = [ask(c) for c in clips]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, clips))
    assert together == alone
    assert len(set(alone)) > 1


def _post_chat(daemon: Daemon, content: object, model: str = "tiny-audio") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=60)


def test_hostile_clips_are_a_400_before_any_decode(daemon: Daemon) -> None:
    client = _openai(daemon)
    # a stream on the same model runs while the hostile requests come and goes on
    stream = client.chat.completions.create(
        model="tiny-audio",
        messages=[
            {"role": "user", "content": [_part(tone_wav(1.0)), {"type": "text", "text": "Go"}]}
        ],  # type: ignore[list-item]
        max_tokens=24,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    question = {"type": "text", "text": "What is it?"}
    cases = {
        "declares hours": ([_part(wav_declaring(3 * 3600)), question], "truncated"),
        "truncated": ([_part(tone_wav(1.0)[:2000]), question], "truncated"),
        "flac bomb": ([_part(flac_bomb(), "flac"), question], "longer than"),
        "ogg": ([_part(b"OggS" + bytes(200), "wav"), question], "WAV, MP3 or FLAC"),
        "format": ([_part(tone_wav(0.1), "aiff"), question], "not read"),
        "base64": (
            [{"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}],
            "base64",
        ),
        "100 clips": ([_part(tone_wav(0.02)) for _ in range(100)], "at most 8"),
    }
    for name, (content, message) in cases.items():
        r = _post_chat(daemon, content)
        assert r.status_code == 400, (name, r.text)
        assert message in r.json()["error"]["message"], (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    for model in ("tiny", "tiny-vision"):
        r = _post_chat(daemon, [_part(tone_wav(0.5)), question], model)
        assert r.status_code == 400, r.text
        assert "does not read audio" in r.json()["error"]["message"]
    # the transcription route: the same checks on the upload, and a form without a file
    with pytest.raises(openai.BadRequestError, match="truncated"):
        client.audio.transcriptions.create(model="tiny-audio", file=("x.wav", tone_wav(1.0)[:999]))
    with pytest.raises(openai.BadRequestError, match="does not read audio"):
        client.audio.transcriptions.create(model="tiny", file=("x.wav", tone_wav(0.5)))
    r = httpx.post(
        daemon.url + "/v1/audio/transcriptions",
        data={"model": "tiny-audio"},
        files={"other": ("x", io.BytesIO(b"x"))},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert "no file" in r.json()["error"]["message"]
    r = httpx.post(
        daemon.url + "/v1/audio/transcriptions",
        data={"model": "tiny-audio", "response_format": "diarized_json"},
        files={"file": ("x.wav", io.BytesIO(tone_wav(0.5)))},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert "response_format" in r.json()["error"]["message"]
    # the stream that ran meanwhile ends as it would have
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert re.search(r"barrel_", httpx.get(daemon.url + "/metrics", timeout=30).text)


def test_a_modelfile_second_from_adds_an_audio_projector(daemon: Daemon, hearing: Path) -> None:
    client = ollama.Client(host=daemon.url, timeout=120)
    data = hearing.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert httpx.post(f"{daemon.url}/api/blobs/{digest}", content=data, timeout=60).is_success
    r = httpx.post(
        daemon.url + "/api/create",
        json={"model": "tiny-hearing", "modelfile": f"FROM tiny\nFROM {digest}\n", "stream": False},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert "audio" in (client.show("tiny-hearing").capabilities or [])
    reply = _chat(
        _openai(daemon),
        [_part(tone_wav(0.5)), {"type": "text", "text": "Hi"}],
        model="tiny-hearing",
    )
    assert reply.usage.prompt_tokens > WINDOW_TOKENS  # type: ignore[attr-defined]


def test_a_browser_page_uploads_audio_only_from_an_allowed_origin(daemon: Daemon) -> None:
    """A multipart form needs no CORS preflight: a foreign page's upload is refused
    before it is read; a local tool's page may send one."""
    form = {"model": "tiny-audio", "response_format": "text", "max_tokens": "4"}

    def upload(origin: str) -> httpx.Response:
        return httpx.post(
            daemon.url + "/v1/audio/transcriptions",
            data=form,
            files={"file": ("x.wav", io.BytesIO(tone_wav(0.5)))},
            headers={"Origin": origin},
            timeout=60,
        )

    refused = upload("https://evil.example")
    assert refused.status_code == 403, refused.text
    assert "not allowed" in refused.json()["error"]["message"]
    served = upload("http://localhost:3000")
    assert served.status_code == 200, served.text
    assert served.headers["content-type"].startswith("text/plain")
