"""Images and audio in a prompt, through a multimodal projector (llama.cpp's mtmd).

A prompt with media is still a token list: each image, and each 30-second window of an
audio clip (Whisper-style encoders read audio in windows), takes as many entries as the
positions it fills in the sequence, all the same negative placeholder derived from the
clip's SHA-256 (and the window's index). Placeholders never reach llama_decode: when
prefill reaches one, the engine thread evaluates the media (`Projector.evaluate`: encode
with the projector, decode the embeddings into the sequence at that position). Because
the placeholder is the bytes' hash, the KV cache's prefix matching reuses a clip's cells
like any tokens: a second turn about the same image or clip computes only the text after.

Thread affinity: `Projector.read` (decoding and preprocessing, tokenizing) is safe from
any thread while the projector is open, as llama-server does it in its HTTP threads;
`evaluate` runs in the engine thread only (it decodes into the context).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import math
import struct
import sys
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as ll
from llama_cpp import mtmd_cpp as mtmd

from barrel.engine.errors import ModelLoadError
from barrel.engine.model import LlamaModel, log_callback
from barrel.errors import InvalidRequest

logger = logging.getLogger(__name__)

_MEDIA_CHUNKS = (1, 2)  # MTMD_INPUT_CHUNK_TYPE_IMAGE, MTMD_INPUT_CHUNK_TYPE_AUDIO
_logging_routed = False


def _route_logs() -> None:
    """mtmd prints to stderr unless told otherwise: its chatter joins llama.cpp's."""
    global _logging_routed
    if not _logging_routed:
        mtmd.mtmd_log_set(log_callback(), ctypes.c_void_p(0))
        mtmd.mtmd_helper_log_set(log_callback(), ctypes.c_void_p(0))
        _logging_routed = True


def placeholder(digest: bytes) -> int:
    """The token-list entry standing for an image with this SHA-256: negative (never a
    vocabulary id), 63 bits of the hash (no client can make two images collide)."""
    return -1 - (int.from_bytes(digest[:8], "big") >> 1)


def window_placeholder(digest: bytes, index: int) -> int:
    """The placeholder of an audio clip's `index`-th window (the first: the clip's)."""
    if index == 0:
        return placeholder(digest)
    return placeholder(hashlib.sha256(digest + index.to_bytes(4, "big")).digest())


def is_placeholder(token: int) -> bool:
    return token < 0


@dataclass(eq=False)
class Media:
    """One preprocessed image or audio window: its mtmd chunk (owned, freed with this
    object), the positions it fills and the placeholder standing for them."""

    token: int
    n_pos: int
    n_tokens: int
    chunk: Any = field(repr=False)

    def __del__(self) -> None:
        chunk, self.chunk = self.chunk, None
        if chunk:
            mtmd.mtmd_input_chunk_free(chunk)


@dataclass(frozen=True)
class Piece:
    """A prompt's image or audio clip: text tokens (some projectors wrap media in marker
    tokens) and media, in order; a clip longer than one window is several media."""

    parts: tuple[tuple[int, ...] | Media, ...]

    @property
    def media(self) -> tuple[Media, ...]:
        return tuple(p for p in self.parts if isinstance(p, Media))

    def tokens(self) -> list[int]:
        out: list[int] = []
        for p in self.parts:
            out += [p.token] * p.n_pos if isinstance(p, Media) else p
        return out


class Projector:
    """A vision projector loaded for one text model (an mtmd context)."""

    def __init__(self, path: Path, model: LlamaModel, *, threads: int, use_gpu: bool) -> None:
        _route_logs()
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, threads)
        params.print_timings = False
        params.warmup = False
        self.path = path
        self.ctx = mtmd.mtmd_init_from_file(str(path).encode(), model.handle, params)
        if not self.ctx:
            raise ModelLoadError(
                f"cannot load the projector {path.name}: not a projector for this model"
            )
        self.reads_images = bool(mtmd.mtmd_support_vision(self.ctx))
        self.reads_audio = bool(mtmd.mtmd_support_audio(self.ctx))
        if not (self.reads_images or self.reads_audio):
            mtmd.mtmd_free(self.ctx)
            self.ctx = None
            raise ModelLoadError(f"the projector {path.name} reads neither images nor audio")
        self._marker = mtmd.mtmd_default_marker()
        self._lock = threading.Lock()  # closing waits for images being prepared

    def close(self) -> None:
        with self._lock:
            if self.ctx:
                mtmd.mtmd_free(self.ctx)
                self.ctx = None

    def read(self, blobs: Mapping[str, bytes]) -> dict[str, Piece]:
        """Decode and preprocess each image or audio clip, given by its SHA-256 (hex): a
        400 for bytes that are neither, or media this projector does not take. The
        bytes were bounded from their headers before (barrel.pipeline.images, .audio)."""
        with self._lock:
            if not self.ctx:
                raise InvalidRequest("the model was unloaded while its media were read")
            return {digest: self._piece(bytes.fromhex(digest), b) for digest, b in blobs.items()}

    def _piece(self, digest: bytes, blob: bytes) -> Piece:
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(blob), False)
        if not bitmap:
            raise InvalidRequest(
                "media could not be decoded (images: PNG, JPEG, GIF, BMP; audio: WAV, MP3, FLAC)"
            )
        kind = "audio" if mtmd.mtmd_bitmap_is_audio(bitmap) else "images"
        if not (self.reads_audio if kind == "audio" else self.reads_images):
            mtmd.mtmd_bitmap_free(bitmap)
            raise InvalidRequest(f"this model's projector does not read {kind}")
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            mtmd.mtmd_bitmap_set_id(bitmap, digest.hex().encode())
            text = mtmd.mtmd_input_text()
            text.text = self._marker
            text.text_len = len(self._marker)
            text.add_special = False
            text.parse_special = True
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            status = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if status != 0:
                raise InvalidRequest(f"{kind} could not be prepared for the projector ({status})")
            parts: list[tuple[int, ...] | Media] = []
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) in _MEDIA_CHUNKS:
                    index = sum(isinstance(p, Media) for p in parts)
                    parts.append(
                        Media(
                            window_placeholder(digest, index),
                            int(mtmd.mtmd_input_chunk_get_n_pos(chunk)),
                            int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
                            mtmd.mtmd_input_chunk_copy(chunk),
                        )
                    )
                    continue
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                parts.append(tuple(ids[j] for j in range(n.value)))
            if not any(isinstance(p, Media) for p in parts):
                raise InvalidRequest(f"the projector made no tokens of these {kind}")
            return Piece(tuple(parts))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def encode(self, media: Media) -> None:
        """Run the projector on an image or window without a text context (trial loads)."""
        status = mtmd.mtmd_encode_chunk(self.ctx, media.chunk)
        if status != 0:
            raise RuntimeError(f"encoding media failed with status {status}")

    def evaluate(self, lctx: Any, media: Media, n_past: int, seq: int, n_batch: int) -> int:
        """Engine thread: encode the image or window and decode it into `seq` at
        `n_past`. Returns the positions it took."""
        new_n_past = ll.llama_pos(0)
        status = mtmd.mtmd_helper_eval_chunk_single(
            self.ctx, lctx, media.chunk, n_past, seq, n_batch, False, ctypes.byref(new_n_past)
        )
        if status != 0:
            raise RuntimeError(f"evaluating media failed with status {status}")
        return int(new_n_past.value) - n_past


def solid_png(rgb: tuple[int, int, int], width: int = 24, height: int = 24) -> bytes:
    """A PNG of one colour (8-bit RGB), written by hand: trial loads and tests need an
    image without an imaging library."""

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


def load_projector(path: Path, model: LlamaModel, *, threads: int, use_gpu: bool) -> Projector:
    try:
        return Projector(path, model, threads=threads, use_gpu=use_gpu)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load the projector {path.name}: {exc}") from exc


def tone_wav(seconds: float = 1.0, rate: int = 16000, hz: float = 440.0) -> bytes:
    """A WAV of a sine tone (16-bit mono PCM), written by hand: trial loads and tests
    need a clip without an audio library."""
    n = int(seconds * rate)
    step = 2 * math.pi * hz / rate
    samples = array.array("h", (int(12000 * math.sin(step * i)) for i in range(n)))
    if sys.byteorder == "big":
        samples.byteswap()
    pcm = samples.tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", len(body)) + body
