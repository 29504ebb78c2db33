"""OpenAI's POST /v1/audio/transcriptions and /v1/audio/translations: a multipart form
(barrel.http.codecs.openai_audio) over the one generation handler.

The form is read as a stream with every part bounded (the file by
`limits.max_audio_bytes`, each text field by 64 KiB, at most 32 parts), and the clip is
checked from its container (barrel.pipeline.audio) before any model is asked for.
"""

from __future__ import annotations

from typing import Any

from aiohttp import BodyPartReader, web

from barrel.errors import InvalidRequest, PayloadTooLarge
from barrel.http.codecs import openai_audio as codec
from barrel.http.generate import SseTransport, conversation_of, serve
from barrel.http.keys import CONFIG
from barrel.pipeline.request import AudioPart

routes = web.RouteTableDef()

_MAX_FIELD = 64 * 1024
_MAX_PARTS = 32


async def _read(part: BodyPartReader, cap: int, what: str) -> bytes:
    out = bytearray()
    while chunk := await part.read_chunk(1 << 16):
        out += chunk
        if len(out) > cap:
            raise PayloadTooLarge(f"{what} is larger than the {cap} bytes allowed")
    return bytes(out)


async def read_form(request: web.Request, max_file: int) -> tuple[dict[str, str], bytes]:
    """The text fields and the uploaded file of a multipart form, each part bounded."""
    if not request.content_type.startswith("multipart/"):
        raise InvalidRequest("send the audio as multipart/form-data with a file field")
    reader = await request.multipart()
    fields: dict[str, str] = {}
    data: bytes | None = None
    for _ in range(_MAX_PARTS):
        part = await reader.next()
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise InvalidRequest("nested multipart forms are not read")
        name = part.name or ""
        if name == "file":
            data = await _read(part, max_file, "the audio file")
        else:
            raw = await _read(part, _MAX_FIELD, f"the form field {name!r}")
            fields[name] = raw.decode("utf-8", errors="replace")
    else:
        raise InvalidRequest(f"a form of more than {_MAX_PARTS} parts")
    if data is None:
        raise InvalidRequest("the form has no file", param="file")
    return fields, data


def _reply(form: codec.Form) -> Any:
    def reply(body: dict[str, Any]) -> web.StreamResponse:
        if form.response_format in codec.TEXT_FORMATS:
            return web.Response(text=body["text"], content_type="text/plain")
        return web.json_response(body)

    return reply


async def _serve(request: web.Request, task: codec.Task) -> web.StreamResponse:
    limits = request.app[CONFIG].limits
    fields, data = await read_form(request, limits.max_audio_bytes)
    form = codec.decode_form(fields, task)
    req = codec.request(form, AudioPart(data=data), conversation_of(request))
    transport = SseTransport(request) if form.stream else None
    encoder = codec.AudioEncoder(form)
    return await serve(request, req, encoder, transport, reply=_reply(form))


@routes.post("/v1/audio/transcriptions")
@routes.post("/audio/transcriptions")
async def transcriptions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "transcribe")


@routes.post("/v1/audio/translations")
@routes.post("/audio/translations")
async def translations(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "translate")
