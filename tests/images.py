"""Small real images for the vision tests: PNG written by hand (zlib and a CRC), so no
imaging library is needed."""

from __future__ import annotations

import base64
import struct
import zlib


def solid_png(rgb: tuple[int, int, int], width: int = 24, height: int = 24) -> bytes:
    """A PNG of one colour (8-bit RGB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


RED = solid_png((255, 0, 0))
BLUE = solid_png((0, 0, 255))
