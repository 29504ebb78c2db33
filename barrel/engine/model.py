"""A loaded GGUF model and its vocabulary, over llama.cpp's C API.

Everything here is read-only after `load()` and safe from any thread: tokenizing and
detokenizing use the vocabulary only, never a context. (A token's piece and whether it
ends generation are looked up once and kept: a dict per model, filled from any thread,
each entry written with the one value llama.cpp gives for it.) Users outside the engine
hold the model (`retain` / `release`) while they use it: `free()` waits for the last of
them, so an unload never frees the vocabulary under a tokenizer.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import llama_cpp as ll

from barrel.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

_backend_ready = False
_llama_logger = logging.getLogger("barrel.llama")
# enum ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continuation
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_last_level = [logging.DEBUG]


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    # Called from llama.cpp's threads. Its chatter (info/debug) goes to DEBUG: a daemon's
    # log should not carry a dump of every tensor at each load.
    lvl = _last_level[0] if level == 5 else _LEVELS.get(level, logging.DEBUG)
    _last_level[0] = lvl
    if lvl == logging.INFO:
        lvl = logging.DEBUG
    if _llama_logger.isEnabledFor(lvl):
        _llama_logger.log(lvl, "%s", text.decode("utf-8", errors="replace").rstrip("\n"))


def log_callback() -> object:
    """llama.cpp's log callback that speaks through Python logging (for the libraries
    beside libllama: mtmd)."""
    return _log


# ggml's CPU "tiled" K-quant matmul (GGML_CPU_TILED_MM, on by default in llama.cpp) takes
# every product of 8 rows or more: 15-30 % faster prefill chunks of Qwen2.5-Coder-0.5B
# on two cores, ~10 % slower steps of eight streams, and it rounds differently from the
# per-row dot products, so a row's logits depend on whether 7 other rows share its step
# (bench/NOTEBOOK.md, "The tiled K-quant matmul" and "Long prompts"). ggml reads the
# variable once, at its first matmul: a process-wide choice (`configure_kernels`).
TILED_MATMUL_ENV = "GGML_CPU_TILED_MM"
# The environment's word on `configure_kernels` (1: batch-invariant, 0: llama.cpp's
# kernels), over the configuration: a fleet or a test suite pins it.
BATCH_INVARIANT_ENV = "BARREL_BATCH_INVARIANT"

_batch_invariant: bool | None = None  # None: not configured (batch-invariant)


def configure_kernels(invariant: bool) -> bool:
    """Choose this process's CPU kernels, before the first model loads. Batch-invariant:
    a row's logits never depend on what shares its step (the tiled matmul and the
    repacked weight buffers off), so a greedy answer is the same alone, beside other
    streams and under speculation; else llama.cpp's own kernels, as llama-server runs
    them: faster prompts. `BARREL_BATCH_INVARIANT` in the environment wins; so does
    `GGML_CPU_TILED_MM` for the tiled matmul. Returns the choice."""
    global _batch_invariant
    word = os.environ.get(BATCH_INVARIANT_ENV, "").strip().lower()
    if word in ("1", "true", "on", "yes"):
        invariant = True
    elif word in ("0", "false", "off", "no"):
        invariant = False
    if _backend_ready and invariant != batch_invariant():
        logger.warning(
            "kernels: batch_invariant=%s comes after the first model load; "
            "the tiled matmul keeps its first setting",
            invariant,
        )
    _batch_invariant = invariant
    logger.info(
        "kernels: %s",
        "batch-invariant (no tiled matmul, no repacked weights)"
        if invariant
        else "llama.cpp's (tiled matmul, repacked weights, as llama-server)",
    )
    return invariant


def batch_invariant() -> bool:
    """The process's choice (`configure_kernels`); batch-invariant until one is made."""
    return _batch_invariant is None or _batch_invariant


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        if batch_invariant():
            os.environ.setdefault(TILED_MATMUL_ENV, "0")
        ll.llama_backend_init()
        ll.llama_log_set(_log, ctypes.c_void_p(0))
        _backend_ready = True


class LoadMode(StrEnum):
    """How the weights are mapped: mmap, mlock, both or read into memory."""

    MMAP = "mmap"
    MLOCK = "mlock"
    MMAP_MLOCK = "mmap_mlock"
    NONE = "none"


_LOAD_MODES = {
    LoadMode.MMAP: ll.LLAMA_LOAD_MODE_MMAP,
    LoadMode.MLOCK: ll.LLAMA_LOAD_MODE_MLOCK,
    LoadMode.MMAP_MLOCK: ll.LLAMA_LOAD_MODE_MMAP_MLOCK,
    LoadMode.NONE: ll.LLAMA_LOAD_MODE_NONE,
}


@dataclass(frozen=True)
class ModelOptions:
    """What shapes the load of a model's weights."""

    n_gpu_layers: int = 0
    load_mode: LoadMode = LoadMode.MMAP
    # llama.cpp's "extra" weight buffers (CPU repack, AMX), as llama-server loads: the
    # Q4_K weights of a Q4_K_M file then decode from an interleaved copy made at load,
    # ~7-10 % faster prefill of Qwen2.5-Coder-0.5B on two cores with the tiled matmul
    # off, and steps of eight streams ~5-10 % faster with it on (TILED_MATMUL_ENV). The
    # repacked kernels round a row differently by how many rows share the step, so a
    # greedy answer depends on what else runs beside it (bench/NOTEBOOK.md). None:
    # on unless the process is batch-invariant (`configure_kernels`). Never on a CPU
    # with AMX, where the 0.3.36 build crashes in llama_decode with them.
    extra_buffers: bool | None = False
    vocab_only: bool = False

    def uses_extra_buffers(self) -> bool:
        """Whether the load offers llama.cpp its extra buffers: never on a CPU with AMX,
        where the pinned build puts K-quant weights in AMX buffers and then dies in the
        first llama_decode (SIGILL), whatever was asked (`LlamaModel.load` warns)."""
        if cpu_has_amx():
            return False
        if self.extra_buffers is None:
            return not batch_invariant()
        return self.extra_buffers


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU has Intel AMX tiles (Linux: /proc/cpuinfo; elsewhere False)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


class LlamaModel:
    """Owns one loaded llama_model and its vocabulary: tokenizing, detokenizing, pieces and
    metadata, from any thread; freed once (`free`)."""

    def __init__(self, path: Path, handle: ll.llama_model_p, opts: ModelOptions) -> None:
        self.path = path
        self.handle = handle
        self.options = opts
        vocab = ll.llama_model_get_vocab(handle)
        if vocab is None:
            raise ModelLoadError(f"{path.name}: model has no vocabulary")
        self.vocab = vocab
        self.n_vocab: int = ll.llama_vocab_n_tokens(vocab)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(handle)
        self.n_embd: int = ll.llama_model_n_embd(handle)
        self.add_bos: bool = ll.llama_vocab_get_add_bos(vocab)
        self.bos: int = ll.llama_vocab_bos(vocab)
        self.eos: int = ll.llama_vocab_eos(vocab)
        # Sliding-window and recurrent models may refuse a partial llama_memory_seq_rm.
        self.n_swa: int = ll.llama_model_n_swa(handle)
        self.swa: bool = self.n_swa > 0
        self.recurrent: bool = bool(
            ll.llama_model_is_recurrent(handle) or ll.llama_model_is_hybrid(handle)
        )
        # token -> its bytes (plain, special) and whether it ends generation: every
        # generated token asks for both, and a Python dict lookup is a fraction of a
        # ctypes call right after a decode (bench/NOTEBOOK.md)
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})
        self._eog: dict[int, bool] = {}
        self._freed = False
        self._holds = 0
        self._free_pending = False
        self._hold_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, opts: ModelOptions | None = None) -> LlamaModel:
        opts = opts or ModelOptions()
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path.name}")
        _init_backend()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = opts.n_gpu_layers
        params.load_mode = _LOAD_MODES[opts.load_mode]
        params.use_extra_bufts = opts.uses_extra_buffers()
        if opts.extra_buffers and not params.use_extra_bufts:
            logger.warning(
                "%s: extra weight buffers left off: the CPU has AMX, where llama.cpp "
                '0.3.36 crashes with them (bench/NOTEBOOK.md, "AMX")',
                path.name,
            )
        params.vocab_only = opts.vocab_only
        handle = ll.llama_model_load_from_file(os.fsencode(path), params)
        if not handle:
            raise ModelLoadError(f"llama.cpp could not load {path.name}")
        return cls(path, handle, opts)

    def retain(self) -> bool:
        """Hold the model (any thread); False once it is freed or being freed."""
        with self._hold_lock:
            if self._freed or self._free_pending:
                return False
            self._holds += 1
            return True

    def release(self) -> None:
        """Let go of a hold; the last one out frees a model whose free was asked for."""
        with self._hold_lock:
            self._holds -= 1
            now = self._free_pending and self._holds == 0
        if now:
            self._free_now()

    def free(self) -> None:
        """Free the model now, or when the last hold is released."""
        with self._hold_lock:
            if self._freed or self._free_pending:
                return
            if self._holds > 0:
                self._free_pending = True
                return
        self._free_now()

    @property
    def freed(self) -> bool:
        return self._freed or self._free_pending

    def _free_now(self) -> None:
        with self._hold_lock:
            if self._freed:
                return
            self._freed = True
        ll.llama_model_free(self.handle)

    # -- metadata -----------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def size_bytes(self) -> int:
        return int(ll.llama_model_size(self.handle))

    # -- vocabulary -----------------------------------------------------------------

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (ll.llama_token * n_max)()
            n = ll.llama_tokenize(
                self.vocab, data, len(data), buf, n_max, add_special, parse_special
            )
        return list(buf[:n])

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token (possibly a partial UTF-8 sequence)."""
        cache = self._pieces[special]
        got = cache.get(token)
        if got is None:
            got = self._piece(token, special)
            if 0 <= token < self.n_vocab:
                cache[token] = got
        return got

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode(
            "utf-8", errors="replace"
        )

    def is_eog(self, token: int) -> bool:
        got = self._eog.get(token)
        if got is None:
            got = bool(ll.llama_vocab_is_eog(self.vocab, token))
            if 0 <= token < self.n_vocab:
                self._eog[token] = got
        return got

    def control_tokens(self, text: str) -> set[int]:
        """The control tokens inside `text` (those left out of output unless rendered
        with special=True)."""
        return {
            t
            for t in self.tokenize(text, add_special=False, parse_special=True)
            if not self.piece(t) and self.piece(t, special=True)
        }

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """A (query, document) pair as a reranker reads it: the GGUF's rerank template
        (`tokenizer.chat_template.rerank`, with {query} and {document}) if it has one,
        else BOS query EOS SEP document EOS as BERT-style rerankers do. The client's
        text is tokenized as text: it cannot spell the template's control tokens."""
        template = self.meta("tokenizer.chat_template.rerank")
        if template is None:
            bos, eos = ll.llama_vocab_bos(self.vocab), ll.llama_vocab_eos(self.vocab)
            sep = ll.llama_vocab_sep(self.vocab)
            q = self.tokenize(query, add_special=False, parse_special=False)
            d = self.tokenize(document, add_special=False, parse_special=False)
            head = [bos] if bos >= 0 else []
            return [*head, *q, eos, *([sep] if sep >= 0 else []), *d, eos]
        out: list[int] = []
        for i, part in enumerate(re.split(r"(\{query\}|\{document\})", template)):
            if i % 2:
                text = query if part == "{query}" else document
                out += self.tokenize(text, add_special=False, parse_special=False)
            elif part:
                out += self.tokenize(part, add_special=i == 0, parse_special=True)
        return out

    def token_id(self, text: str) -> int | None:
        """The id of a token whose text is exactly `text` (special tokens included)."""
        ids = self.tokenize(text, add_special=False, parse_special=True)
        return ids[0] if len(ids) == 1 else None
