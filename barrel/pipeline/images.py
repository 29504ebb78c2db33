"""A request's images, from what each dialect sends to bytes the projector reads.

    req = await load(req, limits, fetch)     after the capability check, before the lease

Inline images (Ollama's base64 `images`, Anthropic's base64 source, data URLs) are
decoded here; http(s) URLs are fetched through `fetch(url, max_bytes)`, which the facade
gives (the network rules of pulls apply). Every image is bounded by `max_image_bytes`
and, from its header, by `max_image_pixels`; their number by `max_images`.

In the prompt each image stands as a marker naming its SHA-256
(`image_marker`), which the chat template renders in the image's place inside its
message; `barrel.pipeline.prompt.prepare` cuts the rendered text at the markers and puts
the projector's tokens for each image there.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import struct
import urllib.parse
from collections.abc import Awaitable, Callable

import msgspec

from barrel.config import LimitsConfig
from barrel.errors import InvalidRequest
from barrel.pipeline.request import ApiRequest, AudioPart, ImagePart, Message

Fetch = Callable[[str, int], Awaitable[bytes]]

# What a model without a projector answers to an image, in every dialect.
REFUSAL = "this model reads text only; images are not supported"


def image_marker(digest: str) -> str:
    """The text an image takes in a rendered prompt (its SHA-256, hex)."""
    return f"<__barrel_image_{digest}__>"


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of_part(part: ImagePart | AudioPart) -> str:
    return part.digest or digest_of(part.data)


def markers_of(digests: set[str]) -> re.Pattern[str]:
    """A pattern matching the markers of these images only (a client's text that spells
    the marker of an image it did not send stays text)."""
    return re.compile("|".join(re.escape(image_marker(d)) for d in sorted(digests)))


def count(req: ApiRequest) -> int:
    return sum(len(m.images) for m in req.messages)


def check(req: ApiRequest, limits: LimitsConfig) -> None:
    """Refusals that need no model (before any lease); the images themselves are read
    by `load`, after the model is known to take them."""
    n = count(req)
    if not n:
        return
    if n > limits.max_images:
        raise InvalidRequest(f"at most {limits.max_images} images are allowed in one request")
    for m in req.messages:
        if m.images and m.role != "user":
            raise InvalidRequest(f"images are read in user messages only, not in {m.role}")
        for image in m.images:
            if image.data:
                continue  # read in `load`, once the model is known to read images
            if not image.url:
                raise InvalidRequest("an image needs its data or a URL")
            elif not image.url.startswith(("data:", "http://", "https://")):
                raise InvalidRequest("an image URL must be a data URL or an http(s) URL")


def _bounded(size: int, limits: LimitsConfig) -> None:
    if size > limits.max_image_bytes:
        raise InvalidRequest(
            f"an image has {size} bytes; at most {limits.max_image_bytes} are allowed"
        )
    if size == 0:
        raise InvalidRequest("an image is empty")


def dimensions(data: bytes) -> tuple[str, int, int]:
    """(format, width, height) from an image's header, before anything decodes it: a
    small file may declare a huge picture (a decompression bomb), and formats the
    projector's decoder does not read are refused here."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return "png", w, h
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return "gif", w, h
    if data[:2] == b"BM" and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return "bmp", abs(w), abs(h)
    if data[:3] == b"\xff\xd8\xff":
        return ("jpeg", *_jpeg_size(data))
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        raise InvalidRequest("WebP images are not read; send PNG, JPEG, GIF or BMP")
    raise InvalidRequest("an image must be PNG, JPEG, GIF or BMP")


# JPEG start-of-frame markers (baseline, progressive, lossless, ...), which carry the size
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker in _SOF:
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return w, h
        i += 2 + length
    raise InvalidRequest("an image could not be decoded (a JPEG without its size)")


def _check_image(data: bytes, limits: LimitsConfig) -> None:
    _bounded(len(data), limits)
    _, w, h = dimensions(data)
    if w <= 0 or h <= 0:
        raise InvalidRequest("an image has no pixels")
    if w * h > limits.max_image_pixels:
        raise InvalidRequest(
            f"an image of {w}x{h} pixels is larger than the {limits.max_image_pixels} allowed"
        )


def data_url(url: str) -> bytes:
    """The bytes of a base64 data URL (data:image/png;base64,...)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise InvalidRequest("a data URL needs a comma before its data")
    if not head.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("an image's data URL is not valid base64") from None


def _ready(image: ImagePart, data: bytes, limits: LimitsConfig) -> ImagePart:
    """Worker thread: the image's bytes decoded (a data URL), checked and hashed, once."""
    if not data:
        data = data_url(image.url)
    _check_image(data, limits)
    return ImagePart(data=data, media_type=image.media_type, digest=digest_of(data))


async def load(req: ApiRequest, limits: LimitsConfig, fetch: Fetch) -> ApiRequest:
    """`req` with every image's bytes in hand (URLs decoded or fetched) and hashed; the
    decoding and hashing (megabytes) run off the event loop."""
    if not count(req):
        return req
    messages: list[Message] = []
    for m in req.messages:
        if not m.images:
            messages.append(m)
            continue
        parts = []
        for p in m.parts:
            if isinstance(p, ImagePart):
                data = p.data
                if not data and not p.url.startswith("data:"):
                    data = await fetch(p.url, limits.max_image_bytes)
                p = await asyncio.to_thread(_ready, p, data, limits)
            parts.append(p)
        messages.append(msgspec.structs.replace(m, parts=tuple(parts)))
    return msgspec.structs.replace(req, messages=tuple(messages))
