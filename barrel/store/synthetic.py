"""A tiny random-weight GGUF for tests and benchmarks.

Architecture qwen2 with a handful of small layers and random weights, but the real
Qwen2.5 tokenizer (vocabulary, merges, special tokens) and its tool-capable chat
template, copied from the Qwen2.5-Coder GGUF. It loads in well under a second and
decodes hundreds of tokens per second, so tests exercise real llama.cpp without the
cost of a real model. Weights come from a fixed seed: the file is deterministic.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from barrel.store import bundled

ARCH = "qwen2"


@dataclass(frozen=True)
class TinyShape:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 8192
    seed: int = 1234
    # Large enough that greedy output wanders over the vocabulary (multi-byte characters
    # included) instead of repeating one token.
    weight_scale: float = 0.5
    embed_scale: float = 0.5
    # The authors' recommended sampling (`general.sampling.<key>`), e.g. (("temp", 0.6),)
    sampling: tuple[tuple[str, float], ...] = ()
    # A reranker instead: qwen3 with rank pooling and a yes/no classifier head (as
    # llama.cpp converts Qwen3-Reranker), scoring p(yes) of the last token.
    rank: bool = False

    def key(self) -> str:
        raw = repr(self).encode()
        return hashlib.sha256(raw).hexdigest()[:12]


def _tokenizer_fields(source: Path) -> dict[str, Any]:
    """The tokenizer of the GGUF at `source`, read once for each version of the file:
    kept in memory and as JSON in the model cache (gguf's reader takes ~6 s over Qwen's
    151k-token vocabulary; the JSON ~0.2 s)."""
    st = source.stat()
    return _read_tokenizer(str(source), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_tokenizer(source: str, size: int, mtime_ns: int) -> dict[str, Any]:
    kept = bundled.cache_dir() / f"tokenizer-{Path(source).stem}-{size}-{mtime_ns}.json"
    try:
        fields: dict[str, Any] = json.loads(kept.read_text())
        return fields
    except (OSError, ValueError):
        pass
    reader = gguf.GGUFReader(source)
    wanted = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.chat_template",
    )
    fields = {k: reader.fields[k].contents() for k in wanted}
    tmp = kept.with_name(f".{kept.name}.{os.getpid()}.tmp")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(fields))
        tmp.replace(kept)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache: read the file again next time
    return fields


Tweak = Callable[[gguf.GGUFWriter, list[str]], None]


def _finish(w: gguf.GGUFWriter, tmp: Path, path: Path) -> Path:
    """Write the file under `tmp`, then move it to `path` (no half-written file there)."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_tiny_gguf(
    path: Path, source: Path, shape: TinyShape = TinyShape(), tweak: Tweak | None = None
) -> Path:
    """Write the tiny model to `path` (atomically), taking the tokenizer from `source`.
    `tweak(writer, tokens)` may overwrite metadata before the file is written (hostile
    files for the tests: a later `add_*` of a key replaces its value)."""
    tok = _tokenizer_fields(source)
    tokens = tok["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list)
    n_vocab = len(tokens)
    rng = np.random.default_rng(shape.seed)
    head_dim = shape.n_embd // shape.n_head
    n_embd_kv = head_dim * shape.n_head_kv

    def weight(*dims: int, scale: float = shape.weight_scale) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float16)

    arch = "qwen3" if shape.rank else ARCH
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, arch)
    w.add_name(f"barrel-tiny-{arch}")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(tok["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(tok["tokenizer.ggml.eos_token_id"]))
    w.add_pad_token_id(int(tok["tokenizer.ggml.padding_token_id"]))
    w.add_add_bos_token(bool(tok["tokenizer.ggml.add_bos_token"]))
    w.add_chat_template(str(tok["tokenizer.chat_template"]))
    if shape.rank:
        w.add_pooling_type(gguf.PoolingType.RANK)
        w.add_array(f"{arch}.classifier.output_labels", ["yes", "no"])
        w.add_string("tokenizer.chat_template.rerank", RERANK_TEMPLATE)
    for key, value in shape.sampling:
        if float(value).is_integer() and key in ("top_k", "penalty_last_n", "mirostat"):
            w.add_int32(f"general.sampling.{key}", int(value))
        else:
            w.add_float32(f"general.sampling.{key}", float(value))

    # numpy shapes are ggml's ne reversed: a (rows, cols) matrix maps cols -> rows.
    # No output.weight: llama.cpp's qwen2 ties it to token_embd.
    w.add_tensor("token_embd.weight", weight(n_vocab, shape.n_embd, scale=shape.embed_scale))
    for i in range(shape.n_layer):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", weight(shape.n_embd, shape.n_embd))
        w.add_tensor(f"{p}.attn_k.weight", weight(n_embd_kv, shape.n_embd))
        w.add_tensor(f"{p}.attn_v.weight", weight(n_embd_kv, shape.n_embd))
        if shape.rank:  # qwen3: normed q and k, no biases
            w.add_tensor(f"{p}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(f"{p}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        else:
            w.add_tensor(f"{p}.attn_q.bias", np.zeros(shape.n_embd, dtype=np.float32))
            w.add_tensor(f"{p}.attn_k.bias", np.zeros(n_embd_kv, dtype=np.float32))
            w.add_tensor(f"{p}.attn_v.bias", np.zeros(n_embd_kv, dtype=np.float32))
        w.add_tensor(f"{p}.attn_output.weight", weight(shape.n_embd, shape.n_embd))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        w.add_tensor(f"{p}.ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        w.add_tensor(f"{p}.ffn_down.weight", weight(shape.n_embd, shape.n_ff))
    w.add_tensor("output_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    if shape.rank:
        w.add_tensor("cls.output.weight", weight(2, shape.n_embd))
    if tweak is not None:
        tweak(w, list(tokens))
    return _finish(w, tmp, path)


# How llama.cpp's conversion of Qwen3-Reranker lays out a (query, document) pair.
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant "
    "passages that answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def tiny_reranker(dest: Path | None = None) -> Path:
    """The tiny model as a reranker (rank pooling, a yes/no head)."""
    return tiny_model(TinyShape(rank=True), dest)


def tiny_model(shape: TinyShape = TinyShape(), dest: Path | None = None) -> Path:
    """The cached tiny model for `shape`, built on first use."""
    directory = dest or bundled.cache_dir()
    arch = "qwen3" if shape.rank else ARCH
    path = directory / f"barrel-tiny-{arch}-{shape.key()}.gguf"
    if path.exists():
        return path
    source = bundled.assemble("qwen2.5-coder-0.5b", dest)
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(path, source, shape)


def write_tiny_lora(
    path: Path, shape: TinyShape = TinyShape(), rank: int = 4, seed: int = 99
) -> Path:
    """A LoRA adapter for the tiny model (attention q/v projections), random weights."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, ARCH)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    head_dim = shape.n_embd // shape.n_head
    outputs = {"attn_q": shape.n_embd, "attn_v": head_dim * shape.n_head_kv}
    for i in range(shape.n_layer):
        for name, n_out in outputs.items():
            a = rng.standard_normal((rank, shape.n_embd), dtype=np.float32)
            b = rng.standard_normal((n_out, rank), dtype=np.float32)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_small_gguf(path: Path, padding_bytes: int = 0, seed: int = 5) -> Path:
    """A small valid GGUF (llama metadata, a chat template with tools, a few tensors),
    padded with a random tensor of `padding_bytes`: test data for the store, which
    reads headers and moves bytes but never loads the weights."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("barrel-small")
    w.add_context_length(131072)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_chat_template("{% if tools %}tools{% endif %}{{ messages }}<think>")
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 16), dtype=np.float32))
    if padding_bytes:
        w.add_tensor("padding", rng.standard_normal(padding_bytes // 4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _encoder_blocks(
    w: gguf.GGUFWriter,
    prefix: str,
    n_layer: int,
    d: int,
    ff: int,
    weight: Callable[..., np.ndarray],
    key_bias: bool = True,
) -> None:
    """A clip encoder's transformer blocks (`v.blk.N`, `a.blk.N`): attention with
    biases, two layer norms, a GELU feed-forward; random weights, unit norms."""
    for i in range(n_layer):
        b = f"{prefix}.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{b}.{name}.weight", weight(d, d).astype(np.float16))
            if key_bias or name != "attn_k":
                w.add_tensor(f"{b}.{name}.bias", np.zeros(d, dtype=np.float32))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"{b}.{name}.weight", np.ones(d, dtype=np.float32))
            w.add_tensor(f"{b}.{name}.bias", np.zeros(d, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_up.weight", weight(ff, d).astype(np.float16))
        w.add_tensor(f"{b}.ffn_up.bias", np.zeros(ff, dtype=np.float32))
        w.add_tensor(f"{b}.ffn_down.weight", weight(d, ff).astype(np.float16))
        w.add_tensor(f"{b}.ffn_down.bias", np.zeros(d, dtype=np.float32))


@dataclass(frozen=True)
class ProjectorShape:
    """A LLaVA-style CLIP projector ("mlp") sized for the tiny model: a 32x32 image in
    8x8 patches is 16 image tokens of the text model's width."""

    image_size: int = 32
    patch_size: int = 8
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 48
    n_layer: int = 2
    seed: int = 4321

    def key(self, text: TinyShape) -> str:
        return hashlib.sha256(repr((self, text.n_embd)).encode()).hexdigest()[:12]


def write_tiny_projector(
    path: Path, shape: ProjectorShape = ProjectorShape(), text: TinyShape = TinyShape()
) -> Path:
    """Write a random-weight vision projector for the tiny model (atomically)."""
    rng = np.random.default_rng(shape.seed)

    def weight(*dims: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32)

    d, ff = shape.n_embd, shape.n_ff
    n_pos = (shape.image_size // shape.patch_size) ** 2
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "clip")
    w.add_name("barrel-tiny-projector")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", shape.patch_size)
    w.add_uint32("clip.vision.embedding_length", d)
    w.add_uint32("clip.vision.feed_forward_length", ff)
    w.add_uint32("clip.vision.block_count", shape.n_layer)
    w.add_uint32("clip.vision.projection_dim", text.n_embd)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    p = shape.patch_size
    w.add_tensor("v.patch_embd.weight", weight(d, 3, p, p).astype(np.float16))
    w.add_tensor("v.position_embd.weight", weight(n_pos, d))
    _encoder_blocks(w, "v", shape.n_layer, d, ff, weight)
    w.add_tensor("mm.0.weight", weight(text.n_embd, d).astype(np.float16))
    w.add_tensor("mm.0.bias", np.zeros(text.n_embd, dtype=np.float32))
    w.add_tensor("mm.2.weight", weight(text.n_embd, text.n_embd, scale=1.0).astype(np.float16))
    w.add_tensor("mm.2.bias", np.zeros(text.n_embd, dtype=np.float32))
    return _finish(w, tmp, path)


def tiny_projector(
    shape: ProjectorShape = ProjectorShape(),
    text: TinyShape = TinyShape(),
    dest: Path | None = None,
) -> Path:
    """The cached projector for the tiny model, built on first use."""
    directory = dest or bundled.cache_dir()
    path = directory / f"barrel-tiny-mmproj-{shape.key(text)}.gguf"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_projector(path, shape, text)


@dataclass(frozen=True)
class AudioProjectorShape:
    """A Qwen2-Audio-style projector ("qwen2a": a Whisper encoder, average-pooled, one
    linear layer) sized for the tiny model. Whisper reads 30-second windows of 16 kHz
    audio (3,000 mel frames); each window is 750 tokens of the text model's width."""

    n_mel: int = 80
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 64
    n_layer: int = 1
    seed: int = 8765

    def key(self, text: TinyShape) -> str:
        return hashlib.sha256(repr((self, text.n_embd)).encode()).hexdigest()[:12]


def write_tiny_audio_projector(
    path: Path, shape: AudioProjectorShape = AudioProjectorShape(), text: TinyShape = TinyShape()
) -> Path:
    """Write a random-weight audio projector for the tiny model (atomically)."""
    rng = np.random.default_rng(shape.seed)

    def weight(*dims: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32)

    d, ff = shape.n_embd, shape.n_ff
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "clip")
    w.add_name("barrel-tiny-audio-projector")
    w.add_type("mmproj")
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", "qwen2a")
    w.add_uint32("clip.audio.num_mel_bins", shape.n_mel)
    w.add_uint32("clip.audio.embedding_length", d)
    w.add_uint32("clip.audio.feed_forward_length", ff)
    w.add_uint32("clip.audio.block_count", shape.n_layer)
    w.add_uint32("clip.audio.projection_dim", text.n_embd)
    w.add_uint32("clip.audio.attention.head_count", shape.n_head)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    # numpy shapes are ggml's ne reversed; conv biases are (channels, 1) as converters write
    w.add_tensor("a.conv1d.1.weight", weight(d, shape.n_mel, 3).astype(np.float16))
    w.add_tensor("a.conv1d.1.bias", np.zeros((d, 1), dtype=np.float32))
    w.add_tensor("a.conv1d.2.weight", weight(d, d, 3).astype(np.float16))
    w.add_tensor("a.conv1d.2.bias", np.zeros((d, 1), dtype=np.float32))
    w.add_tensor("a.position_embd.weight", weight(1500, d))
    # Whisper's key projection has no bias
    _encoder_blocks(w, "a", shape.n_layer, d, ff, weight, key_bias=False)
    w.add_tensor("a.post_ln.weight", np.ones(d, dtype=np.float32))
    w.add_tensor("a.post_ln.bias", np.zeros(d, dtype=np.float32))
    w.add_tensor("mm.a.fc.weight", weight(text.n_embd, d, scale=1.0).astype(np.float16))
    w.add_tensor("mm.a.fc.bias", np.zeros(text.n_embd, dtype=np.float32))
    return _finish(w, tmp, path)


def tiny_audio_projector(
    shape: AudioProjectorShape = AudioProjectorShape(),
    text: TinyShape = TinyShape(),
    dest: Path | None = None,
) -> Path:
    """The cached audio projector for the tiny model, built on first use."""
    directory = dest or bundled.cache_dir()
    path = directory / f"barrel-tiny-audio-mmproj-{shape.key(text)}.gguf"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    return write_tiny_audio_projector(path, shape, text)
