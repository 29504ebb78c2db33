"""OpenAI's audio transcriptions and translations as a codec.

A transcription is a chat turn: the uploaded clip and an instruction ("Transcribe the
audio.", with the language and the client's `prompt` as context) in one user message,
answered by a model whose projector reads audio. Events encode as OpenAI's response
formats: `json` ({"text", "usage"}), `text`, `verbose_json` (one segment spanning the
clip: the model gives no timestamps), `srt` and `vtt` (that segment as a cue); a stream
is `transcript.text.delta` events and one `transcript.text.done` with the usage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import Begin, Data, Frame
from barrel.http.codecs.openai_common import error_frame, progress
from barrel.pipeline.events import ChatEvent, Finished, TextDelta
from barrel.pipeline.request import ApiRequest, AudioPart, Dialect, Message, Options, TextPart

Task = Literal["transcribe", "translate"]
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
TEXT_FORMATS = ("text", "srt", "vtt")
MAX_PROMPT = 4096  # characters of context a client may give
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?")
# OpenAI's other fields (include[], timestamp_granularities[], chunking_strategy)
# change nothing here and are accepted.

INSTRUCTIONS = {
    "transcribe": "Transcribe the audio to text.",
    "translate": "Translate the audio into English text.",
}


@dataclass(frozen=True)
class Form:
    """A transcription request's fields, checked."""

    task: Task
    model: str
    language: str = ""
    prompt: str = ""
    response_format: str = "json"
    temperature: float | None = None
    stream: bool = False
    max_tokens: int | None = None  # llama-server's field; OpenAI's API has none


def _flag(value: str, name: str) -> bool:
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise InvalidRequest(f"{name} must be true or false", param=name)


def decode_form(fields: dict[str, str], task: Task) -> Form:
    """The form's text fields (the file is read by the handler)."""
    model = fields.get("model", "").strip()
    if not model:
        raise InvalidRequest("model is required", param="model")
    fmt = fields.get("response_format", "json") or "json"
    if fmt not in FORMATS:
        raise InvalidRequest(
            f"response_format must be one of {', '.join(FORMATS)}", param="response_format"
        )
    language = fields.get("language", "").strip()
    if language and not _LANGUAGE.fullmatch(language):
        raise InvalidRequest("language must be an ISO-639 code such as en", param="language")
    prompt = fields.get("prompt", "")
    if len(prompt) > MAX_PROMPT:
        raise InvalidRequest(f"prompt may have at most {MAX_PROMPT} characters", param="prompt")
    temperature = None
    if fields.get("temperature", "") != "":
        try:
            temperature = float(fields["temperature"])
        except ValueError:
            raise InvalidRequest("temperature must be a number", param="temperature") from None
        if not 0.0 <= temperature <= 2.0:
            raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    max_tokens = None
    if fields.get("max_tokens", "") != "":
        try:
            max_tokens = int(fields["max_tokens"])
        except ValueError:
            raise InvalidRequest("max_tokens must be an integer", param="max_tokens") from None
        if max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    return Form(
        task=task,
        model=model,
        language=language,
        prompt=prompt,
        response_format=fmt,
        temperature=temperature,
        stream=_flag(fields.get("stream", ""), "stream"),
        max_tokens=max_tokens,
    )


def instruction(form: Form) -> str:
    text = INSTRUCTIONS[form.task]
    if form.language and form.task == "transcribe":
        text += f" The speech is in the language {form.language}."
    if form.prompt:
        text += f"\nEarlier text, and the spelling of names in it: {form.prompt}"
    return text + "\nAnswer with the text only."


def request(form: Form, clip: AudioPart, conversation: str | None) -> ApiRequest:
    options = Options() if form.temperature is None else Options(temperature=form.temperature)
    return ApiRequest(
        model=form.model,
        dialect=Dialect.OPENAI,
        messages=(Message(role="user", parts=(clip, TextPart(instruction(form)))),),
        options=options,
        max_tokens=form.max_tokens,
        stream=form.stream,
        thinking=False,
        conversation=conversation,
    )


def _stamp(seconds: float, comma: bool) -> str:
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{',' if comma else '.'}{ms:03d}"


def render(fmt: str, text: str, seconds: float) -> str:
    """A text response format of the whole transcript (one cue spanning the clip)."""
    if fmt == "srt":
        return f"1\n{_stamp(0, True)} --> {_stamp(seconds, True)}\n{text}\n"
    if fmt == "vtt":
        return f"WEBVTT\n\n{_stamp(0, False)} --> {_stamp(seconds, False)}\n{text}\n"
    return text


@dataclass
class AudioEncoder:
    """Events -> a transcription response or stream. `seconds`: the clip's length, known
    at `begin`."""

    form: Form
    seconds: float = 0.0
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None

    def waiting(self, position: int | None, loading_s: float | None) -> list[Frame]:
        return list(progress(position, loading_s))

    def begin(self, begin: Begin) -> list[Frame]:
        self.seconds = begin.audio_seconds
        return []

    def feed(self, index: int, event: ChatEvent) -> list[Frame]:
        if isinstance(event, TextDelta) and event.text:
            self.text.append(event.text)
            if self.form.stream:
                return [Data({"type": "transcript.text.delta", "delta": event.text})]
        elif isinstance(event, Finished):
            u = event.usage
            self.usage = {
                "type": "tokens",
                "input_tokens": u.prompt_tokens,
                "output_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "input_token_details": {"text_tokens": u.prompt_tokens},
            }
        return []

    @property
    def transcript(self) -> str:
        return "".join(self.text).strip()

    def end(self) -> list[Frame]:
        if not self.form.stream:
            return []
        done: dict[str, Any] = {"type": "transcript.text.done", "text": self.transcript}
        if self.usage is not None:
            done["usage"] = self.usage
        return [Data(done)]

    def full(self) -> dict[str, Any]:
        """The response body: JSON formats as objects, text formats under "text" (the
        handler sends that as text/plain)."""
        text, fmt = self.transcript, self.form.response_format
        if fmt in TEXT_FORMATS:
            return {"text": render(fmt, text, self.seconds)}
        if fmt == "verbose_json":
            return {
                "task": self.form.task,
                "language": "english"
                if self.form.task == "translate"
                else self.form.language or "unknown",
                "duration": round(self.seconds, 3),
                "text": text,
                "segments": [
                    {
                        "id": 0,
                        "seek": 0,
                        "start": 0.0,
                        "end": round(self.seconds, 3),
                        "text": text,
                        "tokens": [],
                        "temperature": self.form.temperature or 0.0,
                        "avg_logprob": 0.0,
                        "compression_ratio": 1.0,
                        "no_speech_prob": 0.0,
                    }
                ],
                "usage": {"type": "duration", "seconds": round(self.seconds, 3)},
            }
        body: dict[str, Any] = {"text": text}
        if self.usage is not None:
            body["usage"] = self.usage
        return body

    def error(self, err: BarrelError) -> list[Frame]:
        return [error_frame(err)]
