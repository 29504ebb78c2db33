"""A request's audio clips, from what each dialect sends to bytes the projector reads.

    check(req, limits)                       before any lease (no model needed)
    req = await load(req, limits)            after the capability check, before the lease

Clips come inline (base64 in a chat part, the bytes of an uploaded file). `load` decodes
and hashes them off the event loop and reads each one's length from its container
before anything decodes the audio: a WAV's header, an MP3's frame headers, a FLAC's
stream info and frame headers (a few kilobytes of FLAC may hold hours of silence, and
its stream info may understate them). What miniaudio (mtmd's reader) cannot read is a
400 naming the formats it can.

In the prompt a clip stands as the same marker as an image (`images.image_marker` of its
SHA-256); the projector's tokens for it replace the marker (barrel.pipeline.chat).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass

import msgspec

from barrel.config import LimitsConfig
from barrel.errors import InvalidRequest
from barrel.pipeline.request import ApiRequest, AudioPart, Message

REFUSAL = "this model does not read audio"
FORMATS = ("wav", "mp3", "flac")
_MAX_CHANNELS = 8
_RATES = (8_000, 192_000)


@dataclass(frozen=True)
class Clip:
    """What a clip's container says of it."""

    format: str
    rate: int
    channels: int
    seconds: float


def count(req: ApiRequest) -> int:
    return sum(len(m.audio) for m in req.messages)


def check(req: ApiRequest, limits: LimitsConfig) -> None:
    """Refusals that need no model (before any lease); the clips themselves are read by
    `load`, once the model is known to take audio."""
    n = count(req)
    if not n:
        return
    if n > limits.max_audio_clips:
        raise InvalidRequest(
            f"at most {limits.max_audio_clips} audio clips are allowed in one request"
        )
    for m in req.messages:
        if m.audio and m.role != "user":
            raise InvalidRequest(f"audio is read in user messages only, not in {m.role}")
        for clip in m.audio:
            if clip.format and clip.format not in FORMATS:
                raise InvalidRequest(
                    f"audio format {clip.format!r} is not read; send {', '.join(FORMATS)}"
                )
            if not clip.data and not clip.encoded:
                raise InvalidRequest("an audio clip needs its data")
            # base64 is 4/3 of the bytes: refuse what cannot fit before decoding it
            if len(clip.encoded) * 3 // 4 > limits.max_audio_bytes + 3:
                _bounded(len(clip.encoded) * 3 // 4, limits)


def _bounded(size: int, limits: LimitsConfig) -> None:
    if size > limits.max_audio_bytes:
        raise InvalidRequest(
            f"an audio clip has {size} bytes; at most {limits.max_audio_bytes} are allowed"
        )
    if size == 0:
        raise InvalidRequest("an audio clip is empty")


def describe(data: bytes) -> Clip:
    """A clip's format, rate, channels and length from its container, before any decode;
    a 400 for containers mtmd's reader does not take and for files that say too little
    or contradict themselves."""
    try:
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
            return _wav(data)
        if data[:4] == b"fLaC":
            return _flac(data)
        if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
            return _mp3(data)
    except (struct.error, IndexError, KeyError):
        raise InvalidRequest("an audio clip's container is malformed") from None
    raise InvalidRequest("an audio clip must be WAV, MP3 or FLAC (Ogg, WebM, MP4/M4A are not read)")


# WAV formats miniaudio decodes: PCM, IEEE float, A-law, mu-law, extensible
_WAV_CODECS = {1, 3, 6, 7, 0xFFFE}


def _wav(data: bytes) -> Clip:
    pos, fmt, size = 12, None, None
    while pos + 8 <= len(data):
        kind, length = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = pos + 8
        if kind == b"fmt " and length >= 16 and body + 16 <= len(data):
            fmt = struct.unpack("<HHIIHH", data[body : body + 16])
        elif kind == b"data":
            size = length
            break
        pos = body + length + (length & 1)
    if fmt is None or size is None:
        raise InvalidRequest("a WAV file without its fmt and data chunks (truncated?)")
    codec, channels, rate, _, _, bits = fmt
    if codec not in _WAV_CODECS:
        raise InvalidRequest(f"WAV encoding {codec:#x} is not read (PCM and float are)")
    available = len(data) - (pos + 8)
    if size in (0, 0xFFFFFFFF):  # written by a streaming writer: the rest of the file
        size = available
    elif size > available:
        raise InvalidRequest(
            f"a WAV file declares {size} bytes of audio and holds {available} (truncated)"
        )
    # the length from what the decoder will read (not the header's byte rate, which a
    # file may set to anything)
    frame = channels * ((bits + 7) // 8)
    if frame == 0 or rate == 0:
        raise InvalidRequest("a WAV file with no samples to read (0 channels, bits or rate)")
    return _checked(Clip("wav", rate, channels, size / (rate * frame)))


# MPEG audio: bitrates (kbit/s) by (version is 1, layer) and index; sample rates by version
_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3_frame(h: bytes) -> tuple[int, int, int, int] | None:
    """(frame bytes, samples, rate, channels) of an MPEG audio frame header, or None."""
    if len(h) < 4 or h[0] != 0xFF or h[1] & 0xE0 != 0xE0:
        return None
    version, layer_bits = (h[1] >> 3) & 3, (h[1] >> 1) & 3
    bitrate_index, rate_index, padding = h[2] >> 4, (h[2] >> 2) & 3, (h[2] >> 1) & 1
    if version == 1 or layer_bits == 0 or bitrate_index in (0, 15) or rate_index == 3:
        return None  # reserved, or free-format (no length to read)
    layer, mpeg1 = 4 - layer_bits, version == 3
    kbps = _BITRATES[(mpeg1, layer)][bitrate_index]
    rate = _MPEG_RATES[version][rate_index]
    channels = 1 if h[3] >> 6 == 3 else 2
    if layer == 1:
        return (12 * kbps * 1000 // rate + padding) * 4, 384, rate, channels
    samples = 1152 if layer == 2 or mpeg1 else 576
    return samples // 8 * kbps * 1000 // rate + padding, samples, rate, channels


def _mp3(data: bytes) -> Clip:
    pos = 0
    if data[:3] == b"ID3" and len(data) >= 10:  # a tag first: its size is synchsafe
        size = data[6] << 21 | data[7] << 14 | data[8] << 7 | data[9]
        pos = 10 + size + (10 if data[5] & 0x10 else 0)
    samples = frames = 0
    rate = channels = 0
    while pos + 4 <= len(data):
        frame = _mp3_frame(data[pos : pos + 4])
        if frame is None:
            if frames == 0:
                raise InvalidRequest("an MP3 file whose first frame is not MPEG audio")
            break  # trailing tags or garbage: decoders stop here too
        length, n, rate, channels = frame
        samples += n
        frames += 1
        pos += max(length, 4)
    if frames == 0:
        raise InvalidRequest("an MP3 file without audio frames (truncated?)")
    return _checked(Clip("mp3", rate, channels, samples / rate))


_FLAC_SYNC = re.compile(b"\xff[\xf8\xf9]")
# samples a frame by its block-size code (None: in the header after the frame number)
_FLAC_BLOCKS = (0, 192, 576, 1152, 2304, 4608, None, None, *(256 << i for i in range(8)))


def crc8(data: bytes) -> int:
    """FLAC's frame-header CRC-8 (polynomial 0x07)."""
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = ((crc << 1) ^ 0x07) & 0xFF if crc & 0x80 else (crc << 1) & 0xFF
    return crc


def _utf8_extra(lead: int) -> int:
    """The bytes after `lead` in FLAC's UTF-8-like number coding (-1: not a lead)."""
    if lead < 0x80:
        return 0
    for n, (shift, value) in enumerate(((5, 6), (4, 14), (3, 30), (2, 62), (1, 126)), 1):
        if lead >> shift == value:
            return n
    return 6 if lead == 0xFE else -1


def _flac_frame(data: bytes, at: int) -> int:
    """The samples of the FLAC frame whose header starts at `at` (0: not a header)."""
    h = data[at : at + 16]
    if len(h) < 6 or h[1] not in (0xF8, 0xF9):
        return 0
    block_code, rate_code = h[2] >> 4, h[2] & 0xF
    if block_code == 0 or rate_code == 0xF or h[3] >> 4 > 10 or h[3] & 1:
        return 0
    extra = _utf8_extra(h[4])  # the frame's number, UTF-8 coded
    if extra < 0:
        return 0
    i = 5 + extra
    block = _FLAC_BLOCKS[block_code]
    if block is None:
        size = 1 if block_code == 6 else 2
        if i + size > len(h):
            return 0
        block = int.from_bytes(h[i : i + size], "big") + 1
        i += size
    i += {12: 1, 13: 2, 14: 2}.get(rate_code, 0)
    if i >= len(h) or crc8(h[:i]) != h[i]:
        return 0
    return block


def _flac(data: bytes) -> Clip:
    if len(data) < 42 or data[4] & 0x7F != 0:
        raise InvalidRequest("a FLAC file without its stream info (truncated?)")
    info = data[8:42]
    rate = int.from_bytes(info[10:13], "big") >> 4
    channels = ((info[12] >> 1) & 7) + 1
    declared = int.from_bytes(info[13:18], "big") & 0xFFFFFFFFF
    pos = 4
    while True:  # metadata blocks, the last one flagged
        if pos + 4 > len(data):
            raise InvalidRequest("a FLAC file whose metadata runs past its end (truncated)")
        last, length = data[pos] & 0x80, int.from_bytes(data[pos + 1 : pos + 4], "big")
        pos += 4 + length
        if last:
            break
    # Every frame header (sync code, valid CRC-8): an upper bound of the samples, which a
    # stream info that understates them cannot hide.
    counted = sum(_flac_frame(data, m.start()) for m in _FLAC_SYNC.finditer(data, pos))
    if counted == 0:
        raise InvalidRequest("a FLAC file without audio frames (truncated?)")
    if rate == 0:
        raise InvalidRequest("a FLAC file with no sample rate")
    return _checked(Clip("flac", rate, channels, max(declared, counted) / rate))


def _checked(clip: Clip) -> Clip:
    if not _RATES[0] <= clip.rate <= _RATES[1]:
        raise InvalidRequest(
            f"an audio clip at {clip.rate} Hz; {_RATES[0]} to {_RATES[1]} Hz are read"
        )
    if not 1 <= clip.channels <= _MAX_CHANNELS:
        raise InvalidRequest(
            f"an audio clip with {clip.channels} channels; at most {_MAX_CHANNELS} are read"
        )
    return clip


def _within(clip: Clip, limits: LimitsConfig) -> None:
    if clip.seconds > limits.max_audio_seconds:
        raise InvalidRequest(
            f"an audio clip of {clip.seconds:.0f} s is longer than the "
            f"{limits.max_audio_seconds:.0f} s allowed"
        )


def ready(clip: AudioPart, limits: LimitsConfig) -> AudioPart:
    """Worker thread: the clip's bytes decoded (base64), checked, measured and hashed."""
    data = clip.data
    if not data:
        try:
            data = base64.b64decode(clip.encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("an audio clip's data is not valid base64") from None
    _bounded(len(data), limits)
    info = describe(data)
    _within(info, limits)
    digest = hashlib.sha256(data).hexdigest()
    return AudioPart(data=data, format=info.format, digest=digest, seconds=info.seconds)


def seconds(req: ApiRequest) -> float:
    """The length of the request's audio clips, once `load` measured them."""
    return sum(p.seconds for m in req.messages for p in m.audio)


async def load(req: ApiRequest, limits: LimitsConfig) -> ApiRequest:
    """`req` with every clip's bytes decoded, bounded, measured and hashed, off the event
    loop (an upload's bytes as a form's file come in `data`, not yet read)."""
    if not count(req):
        return req
    messages: list[Message] = []
    for m in req.messages:
        if not m.audio:
            messages.append(m)
            continue
        parts = []
        for p in m.parts:
            if isinstance(p, AudioPart) and not p.digest:
                p = await asyncio.to_thread(ready, p, limits)
            parts.append(p)
        messages.append(msgspec.structs.replace(m, parts=tuple(parts)))
    return msgspec.structs.replace(req, messages=tuple(messages))
