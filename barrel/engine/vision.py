"""Images in a prompt, through a multimodal projector (llama.cpp's mtmd).

A prompt with images is still a token list: each image takes as many entries as the
positions it fills in the sequence, all the same negative placeholder derived from the
image's SHA-256. Placeholders never reach llama_decode: when prefill reaches one, the
engine thread evaluates the image (`Projector.evaluate`: encode with the projector,
decode the embeddings into the sequence at that position). Because the placeholder is the
image's hash, the KV cache's prefix matching reuses an image's cells like any tokens: a
second turn about the same image computes only the text after it.

Thread affinity: `Projector.images` (decoding and preprocessing, tokenizing) is safe
from any thread while the projector is open, as llama-server does it in its HTTP
threads; `evaluate` runs in the engine thread only (it decodes into the context).
"""

from __future__ import annotations

import ctypes
import logging
import struct
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

_IMAGE_CHUNK = 1  # MTMD_INPUT_CHUNK_TYPE_IMAGE
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


def is_placeholder(token: int) -> bool:
    return token < 0


@dataclass(eq=False)
class Media:
    """One preprocessed image: its mtmd chunk (owned, freed with this object), the
    positions it fills and the placeholder standing for them."""

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
    """A prompt's image, as the tokens that go around it (some projectors wrap an image
    in marker tokens) and its media."""

    before: tuple[int, ...]
    media: Media
    after: tuple[int, ...]

    def tokens(self) -> list[int]:
        return [*self.before, *([self.media.token] * self.media.n_pos), *self.after]


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
        if not mtmd.mtmd_support_vision(self.ctx):
            mtmd.mtmd_free(self.ctx)
            self.ctx = None
            raise ModelLoadError(f"the projector {path.name} reads no images")
        self._marker = mtmd.mtmd_default_marker()
        self._lock = threading.Lock()  # closing waits for images being prepared

    def close(self) -> None:
        with self._lock:
            if self.ctx:
                mtmd.mtmd_free(self.ctx)
                self.ctx = None

    def images(self, blobs: Mapping[str, bytes]) -> dict[str, Piece]:
        """Decode and preprocess each image, given by its SHA-256 (hex): a 400 for bytes
        that are not an image."""
        with self._lock:
            if not self.ctx:
                raise InvalidRequest("the model was unloaded while its images were read")
            return {digest: self._piece(bytes.fromhex(digest), b) for digest, b in blobs.items()}

    def _piece(self, digest: bytes, blob: bytes) -> Piece:
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(blob), False)
        if not bitmap:
            raise InvalidRequest("an image could not be decoded (PNG, JPEG, GIF and BMP are read)")
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
                raise InvalidRequest(
                    f"the image could not be prepared for the projector ({status})"
                )
            before: list[int] = []
            after: list[int] = []
            media: Media | None = None
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) == _IMAGE_CHUNK:
                    media = Media(
                        placeholder(digest),
                        int(mtmd.mtmd_input_chunk_get_n_pos(chunk)),
                        int(mtmd.mtmd_input_chunk_get_n_tokens(chunk)),
                        mtmd.mtmd_input_chunk_copy(chunk),
                    )
                    continue
                n = ctypes.c_size_t(0)
                ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                (after if media is not None else before).extend(ids[i] for i in range(n.value))
            if media is None:
                raise InvalidRequest("the projector made no image tokens of this image")
            return Piece(tuple(before), media, tuple(after))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)

    def encode(self, media: Media) -> None:
        """Run the projector on an image without a text context (trial loads)."""
        status = mtmd.mtmd_encode_chunk(self.ctx, media.chunk)
        if status != 0:
            raise RuntimeError(f"encoding an image failed with status {status}")

    def evaluate(self, lctx: Any, media: Media, n_past: int, seq: int, n_batch: int) -> int:
        """Engine thread: encode the image and decode it into `seq` at `n_past`. Returns
        the positions it took."""
        new_n_past = ll.llama_pos(0)
        status = mtmd.mtmd_helper_eval_chunk_single(
            self.ctx, lctx, media.chunk, n_past, seq, n_batch, False, ctypes.byref(new_n_past)
        )
        if status != 0:
            raise RuntimeError(f"evaluating an image failed with status {status}")
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
