"""Audio files for the tests, written by hand: WAV tones (barrel.engine.projector), a
small FLAC encoder (verbatim subframes, valid CRCs, so miniaudio decodes it) and hostile
files made of real container structures."""

from __future__ import annotations

import math
import struct

from barrel.engine.projector import tone_wav
from barrel.pipeline.audio import crc8

__all__ = ["flac", "flac_bomb", "tone_wav", "wav_declaring"]


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def _utf8(n: int) -> bytes:
    """FLAC's frame numbers: UTF-8's coding of an integer (up to 2**11 here)."""
    if n < 0x80:
        return bytes([n])
    assert n < 0x800
    return bytes([0xC0 | n >> 6, 0x80 | n & 0x3F])


def _stream_info(rate: int, total: int, block: int) -> bytes:
    info = struct.pack(">HH", block, block) + bytes(6)  # frame sizes unknown
    info += (rate << 44 | 0 << 41 | 15 << 36 | total).to_bytes(8, "big")  # mono, 16-bit
    info += bytes(16)  # no MD5
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info


def _frame(index: int, block: int, subframe: bytes) -> bytes:
    # fixed-size stream, block size in the header (code 7), rate from the stream info,
    # mono, 16 bits a sample
    header = b"\xff\xf8" + bytes([0x70, 0x08]) + _utf8(index) + (block - 1).to_bytes(2, "big")
    header += bytes([crc8(header)])
    body = header + subframe
    return body + _crc16(body).to_bytes(2, "big")


def flac(seconds: float, hz: float = 440.0, rate: int = 16000, block: int = 4096) -> bytes:
    """A FLAC of a sine tone (16-bit mono, verbatim subframes)."""
    n = int(seconds * rate)
    samples = [int(12000 * math.sin(2 * math.pi * hz * i / rate)) for i in range(n)]
    out = _stream_info(rate, n, block)
    for index, start in enumerate(range(0, n, block)):
        chunk = samples[start : start + block]
        subframe = b"\x02" + struct.pack(f">{len(chunk)}h", *chunk)  # verbatim
        out += _frame(index, len(chunk), subframe)
    return out


def flac_bomb(frames: int = 2000, rate: int = 16000) -> bytes:
    """A FLAC whose stream info says one second and whose frames hold 65,536 samples of
    silence each in 13 bytes (constant subframes): 26 KB of hours."""
    out = _stream_info(rate, rate, 65535)
    for index in range(frames):
        out += _frame(index, 65536, b"\x00\x00\x00")  # constant subframe, sample 0
    return out


def wav_declaring(seconds: float, rate: int = 16000) -> bytes:
    """A short WAV whose header declares `seconds` of 16-bit mono audio."""
    real = tone_wav(0.1, rate)
    size = int(seconds * rate * 2)
    return real[:40] + struct.pack("<I", size) + real[44:]
