"""GGUF metadata from the header only, bounded, for untrusted files.

`gguf.GGUFReader` maps the whole file and builds Python objects for every field — seconds
for a 150k-token vocabulary, and it trusts the lengths it reads. This reader streams the
header with the `gguf` package's type codes, keeps only the keys Barrel shows, skips the
rest (counting, never allocating by a length it has not checked against the file size)
and refuses anything malformed with `InvalidGGUF` (400).
"""

from __future__ import annotations

import functools
import io
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
    LlamaFileType,
)

from barrel.errors import InvalidRequest

MAGIC = b"GGUF"
MAX_KEY = 1 << 16
MAX_STRING = 16 << 20  # a chat template is tens of KiB; 16 MiB is generous
MAX_COUNT = 1 << 24
MAX_DIMS = 8
_U64 = struct.Struct("<Q")

_SCALARS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}

# Arrays kept whole (small); every other array is skipped.
_KEEP_ARRAYS = {"general.tags", "general.languages"}
_FIM_TOKENS = {
    "<|fim_prefix|>",
    "<fim_prefix>",
    "<PRE>",
    "<|fim_begin|>",
    "<\uff5cfim\u2581begin\uff5c>",  # DeepSeek's full-width bars
}
RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: a reranker's classifier head
ENCODER_ARCHS = {
    "bert",
    "nomic-bert",
    "nomic-bert-moe",
    "jina-bert-v2",
    "t5encoder",
    "neo-bert",
    "modern-bert",
}


class InvalidGGUF(InvalidRequest):
    code = "invalid_gguf"


# Keys llama.cpp and Barrel read as counts: integers in [0, 2^31), never strings, floats
# or booleans ({arch} is the file's architecture).
_COUNT_KEYS = (
    "{arch}.context_length",
    "{arch}.embedding_length",
    "{arch}.block_count",
    "{arch}.feed_forward_length",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.vocab_size",
    "general.file_type",
    "general.alignment",
)
MAX_COUNT_VALUE = (1 << 31) - 1


@dataclass
class GGUFInfo:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensor_count: int = 0
    parameter_count: int = 0
    has_fim_tokens: bool = False
    file_size: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "unknown"))

    def arch_key(self, suffix: str) -> Any:
        return self.get(f"{self.architecture}.{suffix}")

    @property
    def context_length(self) -> int:
        return int(self.arch_key("context_length") or 0)

    @property
    def embedding_length(self) -> int:
        return int(self.arch_key("embedding_length") or 0)

    @property
    def block_count(self) -> int:
        return int(self.arch_key("block_count") or 0)

    @property
    def head_count(self) -> int:
        return int(self.arch_key("attention.head_count") or 0)

    @property
    def head_count_kv(self) -> int:
        value = self.arch_key("attention.head_count_kv") or self.arch_key("attention.head_count")
        return int(value or 0)

    @property
    def pooling_type(self) -> int | None:
        value = self.arch_key("pooling_type")
        return int(value) if value is not None else None

    @property
    def chat_template(self) -> str:
        return str(self.get("tokenizer.chat_template", "") or "")

    @property
    def chat_templates(self) -> dict[str, str]:
        """Named templates (tokenizer.chat_template.<name>), the default one as ''."""
        out = {"": self.chat_template} if self.chat_template else {}
        for key, value in self.metadata.items():
            if key.startswith("tokenizer.chat_template.") and isinstance(value, str):
                out[key.removeprefix("tokenizer.chat_template.")] = value
        return out

    @property
    def quantization(self) -> str:
        ft = self.get("general.file_type")
        if ft is None:
            return "unknown"
        try:
            return LlamaFileType(int(ft)).name.removeprefix("MOSTLY_").replace("ALL_", "")
        except ValueError:
            return f"type{ft}"

    @property
    def size_label(self) -> str:
        label = self.get("general.size_label")
        if label:
            return str(label)
        n = self.parameter_count
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        if n >= 1e6:
            return f"{n / 1e6:.2f}M"
        return f"{n / 1e3:.2f}K" if n else ""

    @property
    def plain_attention(self) -> bool:
        """Every layer attends over every cell (no sliding window, no recurrent state)."""
        return plain_attention(self.metadata)

    @property
    def is_embedding_model(self) -> bool:
        return self.architecture in ENCODER_ARCHS or (self.pooling_type or 0) > 0

    @property
    def capabilities(self) -> list[str]:
        caps = []
        template = "\n".join(self.chat_templates.values())
        if self.pooling_type == RANK_POOLING:
            caps.append("rerank")
        elif self.is_embedding_model:
            caps.append("embedding")
        else:
            caps.append("completion")
            if "tools" in template:
                caps.append("tools")
            if (
                "<think>" in template
                or "enable_thinking" in template
                or "reasoning_content" in template
            ):
                caps.append("thinking")
            if self.has_fim_tokens or self.get("tokenizer.ggml.fim_pre_token_id") is not None:
                caps.append("insert")
        return caps

    def model_info(self) -> dict[str, Any]:
        """Ollama's `model_info`: scalar metadata (vocabulary arrays left out)."""
        info = {
            k: v for k, v in self.metadata.items() if not k.startswith("tokenizer.chat_template")
        }
        info["general.parameter_count"] = self.parameter_count
        return dict(sorted(info.items()))


def plain_attention(metadata: dict[str, Any]) -> bool:
    """From GGUF metadata (or Ollama's `model_info`, the same keys): False for a model
    with sliding-window layers or a recurrent state, whose memory refuses partial
    removals and copies."""
    arch = str(metadata.get("general.architecture", ""))
    if metadata.get(f"{arch}.attention.sliding_window"):
        return False
    return not any(k.startswith((f"{arch}.ssm.", f"{arch}.wkv.")) for k in metadata)


class _Reader:
    """Reads a GGUF header front to back through its own buffer: a vocabulary is
    150,000 length-prefixed strings, and a call into a buffered file (read, tell, seek)
    for each cost more than the parse."""

    CHUNK = 1 << 20

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.buf = b""
        self.off = 0  # the next byte in buf
        self.base = 0  # the file offset of buf[0]

    @property
    def pos(self) -> int:
        return self.base + self.off

    def remaining(self) -> int:
        return self.size - self.pos

    def _fill(self, n: int) -> None:
        """At least n unread bytes in buf."""
        if self.off + n <= len(self.buf):
            return
        rest = self.buf[self.off :]
        self.base += self.off
        self.buf = rest + self.f.read(max(n - len(rest), self.CHUNK))
        self.off = 0
        if len(self.buf) < n:
            raise InvalidGGUF("truncated GGUF header")

    def read(self, n: int) -> bytes:
        self._fill(n)
        data = self.buf[self.off : self.off + n]
        self.off += n
        return data

    def skip(self, n: int) -> None:
        if self.off + n <= len(self.buf):
            self.off += n
            return
        beyond = self.off + n - len(self.buf)
        self.f.seek(beyond, io.SEEK_CUR)
        self.base += len(self.buf) + beyond
        self.buf, self.off = b"", 0

    def strings(self, count: int, limit: int) -> Iterator[bytes]:
        """`count` length-prefixed strings of at most `limit` bytes (the loop a
        vocabulary goes through, kept free of calls)."""
        unpack = _U64.unpack_from
        for _ in range(count):
            if self.off + 8 > len(self.buf):
                self._fill(8)
            n = unpack(self.buf, self.off)[0]
            self.off += 8
            if n > limit or n > self.size - self.base - self.off:
                raise InvalidGGUF(f"a GGUF string claims {n} bytes")
            if self.off + n > len(self.buf):
                self._fill(n)
            yield self.buf[self.off : self.off + n]
            self.off += n

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt, n = _SCALARS[vtype]
        return struct.unpack(fmt, self.read(n))[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self.read(4))[0])

    def u64(self) -> int:
        self._fill(8)
        value: int = _U64.unpack_from(self.buf, self.off)[0]
        self.off += 8
        return value

    def raw_string(self, limit: int = MAX_STRING) -> bytes:
        n = self.u64()
        if n > limit or n > self.remaining():
            raise InvalidGGUF(f"a GGUF string claims {n} bytes")
        return self.read(n)

    def string(self, limit: int = MAX_STRING) -> str:
        return self.raw_string(limit).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.u64()
        if n > self.remaining():
            raise InvalidGGUF(f"a GGUF string claims {n} bytes")
        self.skip(n)

    def value_type(self) -> GGUFValueType:
        code = self.u32()
        try:
            return GGUFValueType(code)
        except ValueError:
            raise InvalidGGUF(f"unknown GGUF value type {code}") from None


def read_gguf(path: str | Path) -> GGUFInfo:
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as raw:
            return _parse(_Reader(io.BufferedReader(raw, 1 << 16), size))
    except OSError as exc:
        raise InvalidGGUF(f"cannot read {p.name}: {exc.strerror}") from None
    except struct.error as exc:
        raise InvalidGGUF(f"malformed GGUF header: {exc}") from None


def _parse(r: _Reader) -> GGUFInfo:
    if r.size < 24 or r.read(4) != MAGIC:
        raise InvalidGGUF("not a GGUF file (bad magic)")
    version = r.u32()
    if version not in (2, 3):
        raise InvalidGGUF(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.u64(), r.u64()
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise InvalidGGUF(f"absurd GGUF counts: {n_tensors} tensors, {n_kv} keys")
    info = GGUFInfo(version, tensor_count=n_tensors, file_size=r.size)
    for _ in range(n_kv):
        key = r.string(MAX_KEY)
        vtype = r.value_type()
        if vtype == GGUFValueType.ARRAY:
            _read_array(r, key, info)
        elif vtype == GGUFValueType.STRING:
            info.metadata[key] = r.string()
        else:
            info.metadata[key] = r.scalar(vtype)
    _check_types(info)
    data_end = 0
    for _ in range(n_tensors):
        r.skip_string()  # name
        n_dims = r.u32()
        if n_dims > MAX_DIMS:
            raise InvalidGGUF(f"a tensor claims {n_dims} dimensions")
        count = 1
        for _ in range(n_dims):
            count *= r.u64()
        kind, offset = r.u32(), r.u64()
        data_end = max(data_end, offset + _nbytes(kind, count))
        info.parameter_count += count
    alignment = int(info.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise InvalidGGUF(f"general.alignment must be a power of two, not {alignment}")
    data_start = -(-r.pos // alignment) * alignment
    if data_start + data_end > r.size:
        missing = data_start + data_end - r.size
        raise InvalidGGUF(f"the file is truncated: its tensors need {missing} more bytes")
    return info


def _nbytes(kind: int, count: int) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise InvalidGGUF(f"a tensor has an unknown type {kind}") from None
    return -(-count // block) * size


def _check_types(info: GGUFInfo) -> None:
    """Values llama.cpp would misread or choke on: counts that are not integers, and
    floats that are not finite."""
    arch = info.architecture
    for template in _COUNT_KEYS:
        key = template.format(arch=arch)
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidGGUF(f"{key} must be an integer, not {type(value).__name__}")
        if not 0 <= value <= MAX_COUNT_VALUE:
            raise InvalidGGUF(f"{key} is out of range: {value}")
    for key, value in info.metadata.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidGGUF(f"{key} must be a finite number, not {value}")


def _read_array(r: _Reader, key: str, info: GGUFInfo) -> None:
    etype = r.value_type()
    count = r.u64()
    min_size = 8 if etype == GGUFValueType.STRING else _SCALARS.get(etype, ("", 1))[1]
    if etype == GGUFValueType.ARRAY or count > MAX_COUNT or count * min_size > r.remaining():
        raise InvalidGGUF(f"GGUF array {key!r} claims {count} elements")
    if etype == GGUFValueType.STRING:
        if key == "tokenizer.ggml.tokens":
            _check_vocabulary(r.strings(count, 1 << 16), info)
        elif key in _KEEP_ARRAYS:
            info.metadata[key] = [
                raw.decode("utf-8", errors="replace") for raw in r.strings(count, 1 << 16)
            ]
        else:
            for _ in range(count):
                r.skip_string()  # seeks past a long one: never read into memory
        return
    fmt, n = _SCALARS[etype]
    if key in _KEEP_ARRAYS and count <= 4096:
        data = r.read(n * count)
        info.metadata[key] = [v[0] for v in struct.iter_unpack(fmt, data)]
    else:
        r.skip(n * count)


def _check_vocabulary(tokens: Iterator[bytes], info: GGUFInfo) -> None:
    """llama.cpp asserts that every token text is unique: check it here, and note
    fill-in-the-middle tokens."""
    seen: set[bytes] = set()
    for i, raw in enumerate(tokens):
        if raw in seen:
            raise InvalidGGUF(f"the vocabulary has a duplicate token (id {i})")
        seen.add(raw)
    info.has_fim_tokens = any(t.encode() in seen for t in _FIM_TOKENS)


@functools.lru_cache(maxsize=64)
def projector_reads(path: Path) -> tuple[str, ...]:
    """The capabilities a projector GGUF gives its model: "vision" for an image
    encoder, "audio" for an audio encoder (files are content-addressed or registered at
    boot: read once). A file that says neither is taken as an older vision projector."""
    try:
        info = read_gguf(path)
    except InvalidRequest:
        return ("vision",)
    reads = [
        cap
        for cap, key in (("vision", "clip.has_vision_encoder"), ("audio", "clip.has_audio_encoder"))
        if info.get(key)
    ]
    return tuple(reads) or ("vision",)
