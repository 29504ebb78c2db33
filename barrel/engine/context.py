"""Engine options, and the llama_context and batch they describe."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import llama_cpp as ll

from barrel.engine.errors import ModelLoadError
from barrel.engine.model import LlamaModel, ModelOptions, batch_invariant
from barrel.engine.projector import Projector, load_projector

logger = logging.getLogger(__name__)


class KVType(StrEnum):
    """The KV cache's element type (llama.cpp's cache_type_k/v)."""

    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"


_KV_TYPES = {
    KVType.F16: ll.GGML_TYPE_F16,
    KVType.Q8_0: ll.GGML_TYPE_Q8_0,
    KVType.Q4_0: ll.GGML_TYPE_Q4_0,
}
_FLASH = {
    "auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
_POOLING = {
    "model": ll.LLAMA_POOLING_TYPE_UNSPECIFIED,
    "mean": ll.LLAMA_POOLING_TYPE_MEAN,
    "cls": ll.LLAMA_POOLING_TYPE_CLS,
    "last": ll.LLAMA_POOLING_TYPE_LAST,
}


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter file and its load-time scale."""

    path: Path
    scale: float = 1.0


@dataclass(frozen=True)
class EngineOptions:
    """Everything that shapes one engine's llama_context and its scheduling, fixed for the
    engine's life."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 4  # sequences for requests
    # Extra sequences holding pinned prefixes (a static system + tools prompt) that
    # requests copy with llama_memory_seq_cp instead of prefilling them.
    max_pins: int = 1
    threads: int = 0  # 0: every core
    kv_type: KVType = KVType.F16
    flash_attn: str = "auto"  # auto | on | off
    # Keep full sliding-window caches so a partial KV removal always works (more memory).
    swa_full: bool = False
    # Prompt tokens per step while other sequences generate: bounds their stall.
    prefill_chunk: int = 128
    # While others generate, size a step's prompt rows to take about this long, at the
    # rate prompt rows cost lately (never fewer than prefill_chunk): a new prompt's first
    # token comes sooner when steps are quick, and no step stalls the streams much longer
    # than this. 0: prefill_chunk rows a step.
    prefill_step_s: float = 0.0
    # Which prompt being prefilled takes a step's prompt rows first: "arrival" (in the
    # order they were admitted, each whole before the next, as llama-server) or
    # "shortest" (fewest rows left; the one admitted first keeps a quarter).
    prefill_order: str = "arrival"
    # When a request wakes an idle engine, wait up to this long for the requests of other
    # open sessions (Engine.expect) to join its first step: concurrent clients arrive a
    # few milliseconds apart, and one that misses the step waits a whole decode step for
    # its first token. 0: start at once.
    gather_s: float = 0.004
    state_cache_bytes: int = 256 * 1024 * 1024  # 0: off
    loras: tuple[LoraAdapter, ...] = ()
    # Prompt-lookup speculative decoding (barrel.engine.speculate): "ngram" or "off";
    # at most `draft_max` draft tokens a step, matched on the last `draft_ngram` tokens.
    speculation: str = "ngram"
    draft_max: int = 64
    draft_ngram: int = 12
    # A draft model (a small GGUF of the same vocabulary) instead of n-gram drafts:
    # `draft_model_tokens` greedy guesses a step (barrel.engine.draft).
    draft_model: Path | None = None
    draft_model_tokens: int = 8
    # A sequence whose grammar takes longer than this to sample one token ends with an
    # error (it would stall the whole batch); 0: no limit.
    grammar_sample_s: float = 0.0
    # Embedding mode: the context outputs pooled embeddings instead of logits.
    embedding: bool = False
    pooling: str = "model"  # model (from the GGUF, mean if it has none) | mean | cls | last
    # A finished conversation's sequence gets its template's next-turn header after this
    # long without a request (NextTurns.decode, barrel.engine.turns).
    next_turn_delay_s: float = 0.2
    # A multimodal projector GGUF (barrel.engine.projector): the model then reads images
    # or audio, whichever its encoders take.
    mmproj: Path | None = None
    # A KV stream of n_ctx cells for each sequence (the context is allocated n_seq_max
    # + max_pins times, as llama-server's -np does) instead of one stream all share:
    # no sequence's attention spans another's cells.
    kv_per_sequence: bool = False


def effective_options(opts: EngineOptions) -> EngineOptions:
    """Adjust options llama.cpp cannot take as given.

    Embedding mode: no pinned sequences, and a micro-batch that is a multiple of the
    sequence count. With mean pooling, llama.cpp 0.3.36 aborts the whole process
    (GGML_ASSERT in ggml_mul_mat while reserving the graph) for some other sizes, e.g.
    n_ubatch 128 with 5 sequences or 100 with 8.
    """
    if not opts.embedding:
        return opts
    n_seq = max(1, opts.n_seq_max)
    ubatch = max(n_seq, min(opts.n_ubatch, opts.n_batch) // n_seq * n_seq)
    return dataclasses.replace(opts, max_pins=0, n_batch=ubatch, n_ubatch=ubatch)


def flash_attention(opts: EngineOptions) -> str:
    """The flash-attention setting a context gets: `auto` is off in a batch-invariant
    process where the KV cache is f16 (a quantized V needs it on). ggml's CPU
    flash-attention kernel takes a query row down one of three paths by the shape of its
    step (64 rows or more tiled, a lone row over 512 cells split between the threads,
    row by row otherwise), each rounding differently: the last token of a 348-token
    prompt decoded alone had logits up to 0.33 away from the same row in the whole
    prompt's step, and 0.0 away with flash attention off (Xeon with AMX and EPYC alike;
    bench/NOTEBOOK.md, "Batch invariance")."""
    if opts.flash_attn == "auto" and batch_invariant() and opts.kv_type is KVType.F16:
        return "off"
    return opts.flash_attn


def new_context(model: LlamaModel, opts: EngineOptions, n_ctx: int) -> Any:
    """Create the context: one KV stream that every sequence shares (one request may
    use the whole n_ctx), or with `kv_per_sequence` a stream of n_ctx cells for each."""
    unified = opts.embedding or not opts.kv_per_sequence
    params = ll.llama_context_default_params()
    params.n_ctx = n_ctx if unified else n_ctx * (opts.n_seq_max + opts.max_pins)
    params.n_batch = opts.n_batch
    params.n_ubatch = min(opts.n_ubatch, opts.n_batch)
    params.n_seq_max = opts.n_seq_max + opts.max_pins
    threads = opts.threads or os.cpu_count() or 1
    params.n_threads = threads
    params.n_threads_batch = threads
    params.type_k = _KV_TYPES[opts.kv_type]
    params.type_v = _KV_TYPES[opts.kv_type]
    # auto: on wherever the backend has it, the CPU included (bench/NOTEBOOK.md,
    # "Long prompts": faster prompts, ~50 ms slower short follow-ups), unless the process
    # is batch-invariant (`flash_attention`)
    params.flash_attn_type = _FLASH[flash_attention(opts)]
    params.kv_unified = unified
    params.swa_full = opts.swa_full
    params.no_perf = True
    if opts.embedding:
        params.embeddings = True
        params.pooling_type = _POOLING[opts.pooling]
    ctx = ll.llama_init_from_model(model.handle, params)
    if not ctx and opts.kv_type is not KVType.F16:
        # A quantized KV cache needs head sizes in whole blocks (and flash attention for
        # V): a model that cannot take it is served with f16, as Ollama does.
        logger.warning(
            "%s: llama.cpp refused a %s KV cache; using f16", model.path.name, opts.kv_type
        )
        params.type_k = params.type_v = _KV_TYPES[KVType.F16]
        ctx = ll.llama_init_from_model(model.handle, params)
    if not ctx:
        raise ModelLoadError(f"llama.cpp could not create a context for {model.path.name}")
    if opts.embedding and ll.llama_pooling_type(ctx) == ll.LLAMA_POOLING_TYPE_NONE:
        # A generative model has no pooling of its own: mean-pool its hidden states.
        ll.llama_free(ctx)
        params.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
        ctx = ll.llama_init_from_model(model.handle, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {model.path.name}")
    return ctx


def open_context(
    model: LlamaModel, opts: EngineOptions, n_ctx: int
) -> tuple[Any, list[Any], Projector | None]:
    """The context, its LoRA adapters and its image projector: all of them, or nothing
    left open."""
    ctx = new_context(model, opts, n_ctx)
    adapters: list[Any] = []
    try:
        adapters = apply_loras(model, ctx, opts.loras)
        projector = None
        if opts.mmproj is not None:
            projector = load_projector(
                opts.mmproj,
                model,
                threads=opts.threads or (os.cpu_count() or 1),
                use_gpu=model.options.n_gpu_layers != 0,
            )
    except BaseException:
        for adapter in adapters:
            ll.llama_adapter_lora_free(adapter)
        ll.llama_free(ctx)
        raise
    return ctx, adapters, projector


def runs_on_cpu(options: ModelOptions) -> bool:
    """No layer of the model is offloaded to a GPU."""
    return options.n_gpu_layers == 0 or not ll.llama_supports_gpu_offload()


def apply_loras(model: LlamaModel, ctx: Any, loras: tuple[LoraAdapter, ...]) -> list[Any]:
    """Load the adapters and set them on the context; returns them for freeing."""
    adapters: list[Any] = []
    try:
        for lora in loras:
            adapter = ll.llama_adapter_lora_init(model.handle, os.fsencode(lora.path))
            if not adapter:
                raise ModelLoadError(f"cannot load LoRA adapter {lora.path}")
            adapters.append(adapter)
        if adapters:
            n = len(adapters)
            arr = (ll.llama_adapter_lora_p_ctypes * n)(*adapters)
            scales = (ctypes.c_float * n)(*[lo.scale for lo in loras])
            if ll.llama_set_adapters_lora(ctx, arr, n, scales) != 0:
                raise ModelLoadError("llama.cpp refused the LoRA adapters")
    except BaseException:
        for adapter in adapters:
            ll.llama_adapter_lora_free(adapter)
        raise
    return adapters


def set_lora_scales(ctx: Any, adapters: list[Any], scales: tuple[float, ...]) -> None:
    """Apply `adapters` with `scales` to the context for the next decodes."""
    n = len(adapters)
    if not n:
        return
    arr = (ll.llama_adapter_lora_p_ctypes * n)(*adapters)
    values = (ctypes.c_float * n)(*scales)
    if ll.llama_set_adapters_lora(ctx, arr, n, values) != 0:
        raise RuntimeError("llama.cpp refused the LoRA scales")


class Batch:
    """A reusable llama_batch of up to `capacity` tokens, one sequence per token."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = ll.llama_batch_init(capacity, 0, 1)
        self.n = 0
        # The arrays' pointers, read once: each `raw.<field>` read builds a new ctypes
        # pointer object, and `add` runs for every token of every step.
        raw = self.raw
        self._token, self._pos, self._logits = raw.token, raw.pos, raw.logits
        self._seq_ids = [raw.seq_id[i] for i in range(capacity)]
        for i in range(capacity):
            raw.n_seq_id[i] = 1  # one sequence per token, always

    def clear(self) -> None:
        self.n = 0
        self.raw.n_tokens = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; returns its index in the batch."""
        i = self.n
        self._token[i] = token
        self._pos[i] = pos
        self._seq_ids[i][0] = seq
        self._logits[i] = logits
        self.n = i + 1
        self.raw.n_tokens = i + 1
        return i

    def seqs(self) -> list[int]:
        """The sequence id of each row, in batch order."""
        return [self.raw.seq_id[i][0] for i in range(self.n)]

    def free(self) -> None:
        ll.llama_batch_free(self.raw)
