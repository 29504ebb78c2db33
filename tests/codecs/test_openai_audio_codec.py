"""The transcription codec (forms, formats, stream frames) and the audio containers read
before any decode (barrel.pipeline.audio), without a model."""

from __future__ import annotations

import base64
import random
import struct

import pytest

from barrel.config import LimitsConfig
from barrel.errors import InvalidRequest
from barrel.http.codecs import Data
from barrel.http.codecs import openai_audio as codec
from barrel.http.codecs.openai_chat import parts_of
from barrel.pipeline import audio
from barrel.pipeline.events import Finished, TextDelta
from barrel.pipeline.request import AudioPart
from barrel.values import Usage
from tests.sounds import flac, flac_bomb, tone_wav, wav_declaring


def test_a_form_is_checked_field_by_field() -> None:
    form = codec.decode_form(
        {"model": "m", "language": "en", "response_format": "srt", "stream": "true"}, "transcribe"
    )
    assert (form.language, form.response_format, form.stream) == ("en", "srt", True)
    for fields, param in [
        ({}, "model"),
        ({"model": "m", "response_format": "diarized_json"}, "response_format"),
        ({"model": "m", "language": "english; drop table"}, "language"),
        ({"model": "m", "temperature": "hot"}, "temperature"),
        ({"model": "m", "temperature": "3"}, "temperature"),
        ({"model": "m", "stream": "maybe"}, "stream"),
        ({"model": "m", "max_tokens": "0"}, "max_tokens"),
        ({"model": "m", "prompt": "x" * 5000}, "prompt"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            codec.decode_form(fields, "transcribe")
        assert refused.value.param == param


def test_the_instruction_carries_the_language_and_the_prompt() -> None:
    form = codec.decode_form({"model": "m", "language": "de", "prompt": "Zürich"}, "transcribe")
    req = codec.request(form, AudioPart(data=b"x"), None)
    [message] = req.messages
    clip, text = message.parts
    assert isinstance(clip, AudioPart)
    assert "de" in text.text  # type: ignore[union-attr]
    assert "Zürich" in text.text  # type: ignore[union-attr]
    assert req.thinking is False
    translate = codec.decode_form({"model": "m"}, "translate")
    assert "English" in codec.instruction(translate)


def _fed(form: codec.Form, seconds: float) -> tuple[codec.AudioEncoder, list[object]]:
    enc = codec.AudioEncoder(form, seconds)
    frames: list[object] = []
    for event in (TextDelta("Hello"), TextDelta(" world ")):
        frames += enc.feed(0, event)
    frames += enc.feed(0, Finished("stop", Usage(800, 3, 0, 800)))
    frames += enc.end()
    return enc, frames


def test_each_format_and_the_stream() -> None:
    for fmt, expected in [
        ("text", "Hello world"),
        ("srt", "1\n00:00:00,000 --> 00:01:02,250\nHello world\n"),
        ("vtt", "WEBVTT\n\n00:00:00.000 --> 00:01:02.250\nHello world\n"),
    ]:
        enc, frames = _fed(codec.Form("transcribe", "m", response_format=fmt), 62.25)
        assert frames == []
        assert enc.full() == {"text": expected}
    enc, _ = _fed(codec.Form("transcribe", "m"), 1.0)
    assert enc.full()["text"] == "Hello world"
    assert enc.full()["usage"]["input_tokens"] == 800
    verbose, _ = _fed(codec.Form("translate", "m", response_format="verbose_json"), 2.5)
    body = verbose.full()
    assert (body["task"], body["language"], body["duration"]) == ("translate", "english", 2.5)
    assert body["segments"][0]["end"] == 2.5
    _, frames = _fed(codec.Form("transcribe", "m", stream=True), 1.0)
    assert [f.payload["type"] for f in frames if isinstance(f, Data)] == [
        "transcript.text.delta",
        "transcript.text.delta",
        "transcript.text.done",
    ]
    done = frames[-1]
    assert isinstance(done, Data)
    assert done.payload["text"] == "Hello world"


def test_input_audio_parts_in_chat_content() -> None:
    data = base64.b64encode(tone_wav(0.1)).decode()
    [part] = parts_of(
        [{"type": "input_audio", "input_audio": {"data": data, "format": "WAV"}}], "c"
    )
    assert isinstance(part, AudioPart)
    assert (part.encoded, part.format) == (data, "wav")
    with pytest.raises(InvalidRequest, match="base64 string"):
        parts_of([{"type": "input_audio", "input_audio": {"data": 5}}], "c")


# -- containers, before any decode ------------------------------------------------------


def _mp3(frames: int, id3: bool = False) -> bytes:
    """MPEG-1 layer III frames at 128 kbit/s, 44.1 kHz, stereo: 417 bytes, 1,152 samples
    each (zero side information: silence)."""
    frame = b"\xff\xfb\x90\x00" + bytes(413)
    tag = b"ID3\x04\x00\x00\x00\x00\x01\x00" + bytes(128) if id3 else b""
    return tag + frame * frames + b"TAG" + bytes(125)  # an ID3v1 tag at the end


def test_lengths_come_from_the_container() -> None:
    assert audio.describe(tone_wav(1.5)) == audio.Clip("wav", 16000, 1, 1.5)
    # chunks before the data chunk are skipped
    wav = tone_wav(0.5)
    listed = wav[:36] + b"LIST" + struct.pack("<I", 4) + b"INFO" + wav[36:]
    assert audio.describe(listed).seconds == pytest.approx(0.5)
    assert audio.describe(flac(2.0)) == audio.Clip("flac", 16000, 1, 2.0)
    assert audio.describe(_mp3(100)).seconds == pytest.approx(100 * 1152 / 44100)
    assert audio.describe(_mp3(10, id3=True)).channels == 2


def test_what_is_refused_before_any_decode() -> None:
    limits = LimitsConfig()
    for data, message in [
        (wav_declaring(3 * 3600), "truncated"),
        (tone_wav(1.0)[:2000], "truncated"),
        (tone_wav(1.0)[:30], "fmt and data"),
        (flac(1.0)[:30], "stream info"),
        (b"OggS" + bytes(100), "WAV, MP3 or FLAC"),
        (b"\x00\x00\x00\x20ftypM4A " + bytes(100), "WAV, MP3 or FLAC"),
        (b"\xff\xfb\x90", "MP3"),
        (tone_wav(0.1, rate=4000), "Hz"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            audio.ready(AudioPart(data=data), limits)
    # a few kilobytes of FLAC whose frames hold hours, whatever its stream info says
    with pytest.raises(InvalidRequest, match="longer than"):
        audio.ready(AudioPart(data=flac_bomb()), limits)
    with pytest.raises(InvalidRequest, match="longer than"):
        audio.ready(AudioPart(data=_mp3(30_000)), limits)  # 784 s in 12 MB
    with pytest.raises(InvalidRequest, match="bytes"):
        audio.ready(AudioPart(data=tone_wav(2.0)), LimitsConfig(max_audio_bytes=1000))
    with pytest.raises(InvalidRequest, match="base64"):
        audio.ready(AudioPart(encoded="%%%"), limits)


def test_mangled_containers_are_refused_or_read_never_crash() -> None:
    rng = random.Random(7)
    for good in (tone_wav(0.2), flac(0.3), _mp3(20, id3=True)):
        for _ in range(300):
            data = bytearray(good[: rng.randrange(len(good) + 1)])
            for _ in range(rng.randrange(4)):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            try:
                clip = audio.describe(bytes(data))
            except InvalidRequest:
                continue
            assert clip.seconds >= 0


def test_a_wav_length_ignores_the_header_byte_rate() -> None:
    wav = tone_wav(0.5, rate=8000)
    lying = wav[:28] + struct.pack("<I", 2**31) + wav[32:]  # the byte rate field
    assert audio.describe(lying).seconds == pytest.approx(0.5)


def test_a_long_clip_within_the_byte_limit_is_refused_by_its_length() -> None:
    header = tone_wav(0.0, rate=8000)
    size = 620 * 8000 * 2  # 620 s of 8 kHz 16-bit mono: 9.9 MB
    long = header[:40] + struct.pack("<I", size) + bytes(size)
    with pytest.raises(InvalidRequest, match="620 s is longer than the 600 s allowed"):
        audio.ready(AudioPart(data=long), LimitsConfig())
