"""The engine: one thread owning one llama_context, with continuous batching.

Thread affinity: `Engine.submit`, `cancel`, `embed`, `stop` and the tokenizer helpers may be
called from any thread; they only put commands in the inbox. Everything else runs in the
engine thread, the only code that touches the context.

Each step is one `llama_decode` holding the next token of every generating sequence plus
chunks of waiting prompts (at most `prefill_chunk` prompt tokens while others generate),
so a long prompt never freezes the streams already running. New requests join between
steps. Finished sequences stay parked with their tokens for KV reuse.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import llama_cpp as ll

from barrel.engine import stream as streams
from barrel.engine.errors import (
    EngineCrashed,
    EngineStopped,
    KVCacheFull,
    ModelLoadError,
    PromptTooLong,
)
from barrel.engine.kvcache import Slot, StateCache, common_prefix
from barrel.engine.model import LlamaModel
from barrel.engine.sampler import Sampler
from barrel.engine.stream import Stream
from barrel.engine.text import StopMatcher, Utf8Stream
from barrel.engine.types import (
    Delta,
    Done,
    Event,
    FinishReason,
    GenerationRequest,
    RequestId,
    Timings,
    TokenLogprob,
    Usage,
)
from barrel.errors import BarrelError

logger = logging.getLogger(__name__)


class KVType(StrEnum):
    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"


_KV_TYPES = {KVType.F16: ll.GGML_TYPE_F16, KVType.Q8_0: ll.GGML_TYPE_Q8_0, KVType.Q4_0: ll.GGML_TYPE_Q4_0}
_FLASH = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}


@dataclass(frozen=True)
class LoraAdapter:
    path: Path
    scale: float = 1.0


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 4
    threads: int = 0  # 0: every core
    kv_type: KVType = KVType.F16
    flash_attn: str = "auto"  # auto | on | off
    # Keep full sliding-window caches so a partial KV removal always works (more memory).
    swa_full: bool = False
    # Prompt tokens per step while other sequences generate: bounds their stall.
    prefill_chunk: int = 128
    state_cache_bytes: int = 256 * 1024 * 1024  # 0: off
    state_cache_dir: Path | None = None
    state_cache_disk_bytes: int = 1024 * 1024 * 1024
    loras: tuple[LoraAdapter, ...] = ()
    # Embedding mode: the context outputs pooled embeddings instead of logits.
    embedding: bool = False
    pooling: str = "model"  # model (from the GGUF, mean if none) | mean | cls | last


class EngineObserver(Protocol):
    """Receives the engine's measurements (engine thread). See barrel.metrics."""

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, usage: Usage, timings: Timings) -> None: ...


class _NoObserver:
    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def finished(self, usage: Usage, timings: Timings) -> None:
        pass


# -- inbox commands -----------------------------------------------------------------


@dataclass
class _Submit:
    run: _Run


@dataclass(frozen=True)
class _Cancel:
    id: RequestId


@dataclass(frozen=True)
class _Embed:
    inputs: list[list[int]]
    normalize: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[list[float]]]


@dataclass(frozen=True)
class _Fault:
    error: BaseException


class _Wake:
    pass


class _Stop:
    pass


@dataclass
class _Run:
    """A request's state inside the engine thread."""

    id: RequestId
    req: GenerationRequest
    stream: Stream
    submitted: float
    sampler: Sampler | None = None
    slot: Slot | None = None
    n_past: int = 0  # prompt/generated tokens in the KV for this sequence
    pending: int | None = None  # sampled, not yet decoded
    generated: list[int] = field(default_factory=list)
    reused: int = 0
    reuse_note: str = ""
    utf8: Utf8Stream = field(default_factory=Utf8Stream)
    stops: StopMatcher | None = None
    cancelled: bool = False
    admitted: float = 0.0
    prefill_done: float = 0.0
    last_token_at: float = 0.0
    out: list[Event | BaseException] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.req.prompt)


class Engine:
    """One model, one context, one thread."""

    def __init__(
        self,
        model: LlamaModel,
        options: EngineOptions | None = None,
        *,
        name: str = "model",
        observer: EngineObserver | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.model = model
        self.options = opts = options or EngineOptions()
        self.name = name
        self.observer: EngineObserver = observer or _NoObserver()
        self.on_crash = on_crash
        self.n_ctx = min(opts.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else opts.n_ctx
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        # Held while checking liveness and queueing, and while the dying thread drains its
        # inbox: a request can never be queued after the last drain and hang.
        self._gate = threading.Lock()
        self.crashed: BaseException | None = None
        self.steps = 0  # decode steps done (engine thread; read elsewhere for tests)
        self.ctx = self._new_context()
        self._loras: list[Any] = []
        try:
            self._apply_loras()
        except BaseException:
            ll.llama_free(self.ctx)
            raise
        self.mem = ll.llama_get_memory(self.ctx)
        self.slots = [Slot(i) for i in range(opts.n_seq_max)]
        self.cache = StateCache(
            opts.state_cache_bytes, opts.state_cache_dir, opts.state_cache_disk_bytes
        )
        self._batch = ll.llama_batch_init(max(opts.n_batch, 1), 0, 1)
        self._waiting: deque[_Run] = deque()
        self._active: list[_Run] = []
        self._runs: dict[RequestId, _Run] = {}
        self._dirty: dict[RequestId, _Run] = {}  # runs with events to deliver this step

    # -- set-up ---------------------------------------------------------------------

    def _new_context(self) -> ll.llama_context_p:
        o = self.options
        params = ll.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = o.n_batch
        params.n_ubatch = min(o.n_ubatch, o.n_batch)
        params.n_seq_max = o.n_seq_max
        threads = o.threads or os.cpu_count() or 1
        params.n_threads = threads
        params.n_threads_batch = threads
        params.type_k = _KV_TYPES[o.kv_type]
        params.type_v = _KV_TYPES[o.kv_type]
        params.flash_attn_type = _FLASH[o.flash_attn]
        params.kv_unified = True  # one request may use the whole n_ctx
        params.swa_full = o.swa_full
        params.no_perf = True
        if o.embedding:
            params.embeddings = True
            params.pooling_type = {
                "model": ll.LLAMA_POOLING_TYPE_UNSPECIFIED,
                "mean": ll.LLAMA_POOLING_TYPE_MEAN,
                "cls": ll.LLAMA_POOLING_TYPE_CLS,
                "last": ll.LLAMA_POOLING_TYPE_LAST,
            }[o.pooling]
        ctx = ll.llama_init_from_model(self.model.handle, params)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {self.model.path}")
        if o.embedding and ll.llama_pooling_type(ctx) == ll.LLAMA_POOLING_TYPE_NONE:
            # A generative model has no pooling of its own: mean-pool its hidden states.
            ll.llama_free(ctx)
            params.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
            ctx = ll.llama_init_from_model(self.model.handle, params)
            if not ctx:
                raise ModelLoadError(f"llama.cpp could not create a context for {self.model.path}")
        return ctx

    def _apply_loras(self) -> None:
        if not self.options.loras:
            return
        for lora in self.options.loras:
            adapter = ll.llama_adapter_lora_init(self.model.handle, os.fsencode(lora.path))
            if not adapter:
                raise ModelLoadError(f"cannot load LoRA adapter {lora.path}")
            self._loras.append(adapter)
        n = len(self._loras)
        adapters = (ll.llama_adapter_lora_p_ctypes * n)(*self._loras)
        scales = (ctypes.c_float * n)(*[lo.scale for lo in self.options.loras])
        if ll.llama_set_adapters_lora(self.ctx, adapters, n, scales) != 0:
            raise ModelLoadError("llama.cpp refused the LoRA adapters")

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is in flight, stop the thread, free the context. Any thread."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine %s did not stop within %ss", self.name, timeout)
                return
        self._free()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    # -- API (any thread) -----------------------------------------------------------

    def submit(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Stream:
        """Queue a generation; read the returned stream on `loop` (default: the running
        loop). Bad input raises here, before any slow work."""
        loop = loop or asyncio.get_running_loop()
        if self.options.embedding:
            raise BarrelError("this model is loaded for embeddings only")
        if not req.prompt:
            raise PromptTooLong("the prompt is empty")
        if len(req.prompt) >= self.n_ctx:
            raise PromptTooLong(
                f"the prompt has {len(req.prompt)} tokens; the context holds {self.n_ctx}"
            )
        # Built here, in the caller's thread (it needs the vocabulary only): a bad grammar
        # fails the request before it is queued.
        sampler = Sampler(self.model, req.sampling, self.n_ctx)
        rid = RequestId(next(self._ids))
        s = Stream(rid, loop, self.cancel, self._resume)
        with self._gate:
            if not self.alive:
                sampler.free()
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._inbox.put(_Submit(_Run(rid, req, s, time.monotonic(), sampler)))
        return s

    def cancel(self, request_id: RequestId) -> None:
        self._inbox.put(_Cancel(request_id))

    def _resume(self) -> None:
        self._inbox.put(_Wake())

    def embed(
        self, inputs: list[list[int]], *, normalize: bool = True, loop: asyncio.AbstractEventLoop | None = None
    ) -> asyncio.Future[list[list[float]]]:
        loop = loop or asyncio.get_running_loop()
        if not self.options.embedding:
            raise BarrelError("this model is not loaded for embeddings")
        for toks in inputs:
            if len(toks) > min(self.n_ctx, self.options.n_ubatch):
                raise PromptTooLong(f"an input has {len(toks)} tokens; the limit is {self.options.n_ubatch}")
        fut: asyncio.Future[list[list[float]]] = loop.create_future()
        with self._gate:
            if not self.alive:
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._inbox.put(_Embed(inputs, normalize, loop, fut))
        return fut

    def inject_fault(self, error: BaseException) -> None:
        """Tests only: make the engine thread raise `error` at its next step."""
        self._inbox.put(_Fault(error))

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    # -- the loop (engine thread) ---------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain(block=not self._has_work())
                if self._stopped.is_set():
                    break
                self._admit()
                if self._active:
                    self._step()
            self._fail_all(EngineStopped(f"engine {self.name} stopped", retry_after=1.0))
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine
            logger.exception("engine %s crashed", self.name)
            self.crashed = exc
            self._stopped.set()
            self._fail_all(EngineCrashed(f"engine {self.name} crashed: {exc}", retry_after=1.0))
            if self.on_crash is not None:
                try:
                    self.on_crash(exc)
                except Exception:
                    logger.exception("on_crash callback")
        finally:
            with self._gate:
                self._stopped.set()
                self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        """The thread is ending: answer whatever is still queued."""
        error = EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Submit):
                self._runs[cmd.run.id] = cmd.run
                self._waiting.append(cmd.run)
            elif isinstance(cmd, _Embed):
                cmd.loop.call_soon_threadsafe(_reject, cmd.future, error)
        if self._waiting:
            self._fail_all(error)

    def _has_work(self) -> bool:
        if self._waiting and any(not s.busy for s in self.slots):
            return True
        return any(self._runnable(r) for r in self._active)

    @staticmethod
    def _runnable(run: _Run) -> bool:
        """False while the run's reader is too far behind (see barrel.engine.stream)."""
        s = run.stream
        if s.paused and s.backlog <= s.high_water // 2:
            s.paused = False
        return not s.paused

    def _drain(self, *, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Submit):
            self._runs[cmd.run.id] = cmd.run
            self._waiting.append(cmd.run)
        elif isinstance(cmd, _Cancel):
            run = self._runs.get(cmd.id)
            if run is not None:
                run.cancelled = True
                if run in self._waiting:
                    self._waiting.remove(run)
                    self._finish(run, FinishReason.CANCELLED)
                    self._flush(self._take_outputs())
        elif isinstance(cmd, _Embed):
            self._embed(cmd)
        elif isinstance(cmd, _Fault):
            raise cmd.error
        elif isinstance(cmd, _Stop):
            self._stopped.set()
        # _Wake: nothing to do, the loop re-evaluates paused streams.

    # -- admission and KV reuse -------------------------------------------------

    def _admit(self) -> None:
        while self._waiting:
            free = [s for s in self.slots if not s.busy]
            if not free:
                return
            run = self._waiting.popleft()
            slot, keep = self._choose_slot(run, free)
            self._attach(run, slot, keep)

    def _choose_slot(self, run: _Run, free: list[Slot]) -> tuple[Slot, int]:
        prompt = run.req.prompt
        session = run.req.session

        def score(s: Slot) -> tuple[int, int, float]:
            # longest common prefix, then empty over parked, then least recently used
            return (common_prefix(s.tokens, prompt), 0 if s.tokens else 1, -s.last_used)

        own = [s for s in free if session is not None and s.session == session]
        own_best = max(own, key=score) if own else None
        if own_best is not None and common_prefix(own_best.tokens, prompt) > 0:
            best = own_best
        else:
            best = max(free, key=score)
        return best, common_prefix(best.tokens, prompt)

    def _attach(self, run: _Run, slot: Slot, lcp: int) -> None:
        prompt = run.req.prompt
        now = time.monotonic()
        run.admitted = now
        # At least one prompt token is decoded to get logits for the first sample.
        keep = min(lcp, len(prompt) - 1)
        if keep < len(slot.tokens) and slot.tokens and slot.session is not None:
            self._save_state(slot)
        restored = self._restore_from_cache(slot, prompt, keep)
        if restored:
            keep = min(restored, len(prompt) - 1)
        keep = self._trim(slot, keep, run)
        slot.busy = True
        slot.session = run.req.session
        slot.touch()
        run.slot = slot
        run.n_past = keep
        run.reused = keep
        run.stops = StopMatcher(run.req.stop) if run.req.stop else None
        self._active.append(run)

    def _trim(self, slot: Slot, keep: int, run: _Run) -> int:
        """Drop the slot's KV past `keep`; fall back to a full recompute if the model's
        memory refuses a partial removal (sliding-window or recurrent models)."""
        if keep >= len(slot.tokens):
            del slot.tokens[keep:]
            return keep
        ok = bool(ll.llama_memory_seq_rm(self.mem, slot.seq, keep, -1))
        if ok and keep > 0 and (self.model.swa or self.model.recurrent):
            # A sliding-window cache may have dropped the early positions already.
            ok = ll.llama_memory_seq_pos_min(self.mem, slot.seq) <= 0
        if not ok:
            ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            if keep > 0:
                run.reuse_note = (
                    f"{keep} cached prompt tokens could not be reused: the model's memory "
                    "refused a partial removal (sliding-window or recurrent model)"
                )
            keep = 0
        del slot.tokens[keep:]
        return keep

    def _save_state(self, slot: Slot) -> None:
        if not self.cache.enabled or not slot.tokens:
            return
        size = ll.llama_state_seq_get_size(self.ctx, slot.seq)
        if size <= 0 or size > self.cache.ram_bytes:
            return
        buf = (ctypes.c_uint8 * size)()
        n = ll.llama_state_seq_get_data(self.ctx, buf, size, slot.seq)
        if n > 0:
            self.cache.put(list(slot.tokens), slot.session, bytes(buf)[:n])

    def _restore_from_cache(self, slot: Slot, prompt: list[int], keep: int) -> int:
        if not self.cache.enabled:
            return 0
        found = self.cache.best(prompt, keep)
        if found is None:
            return 0
        key, saved, n = found
        data = self.cache.take(key)
        if data is None:
            return 0
        ll.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if ll.llama_state_seq_set_data(self.ctx, buf, len(data), slot.seq) == 0:
            logger.warning("engine %s: restoring a cached sequence state failed", self.name)
            slot.tokens = []
            return 0
        slot.tokens = list(saved.tokens)
        return n

    def _evict_parked(self) -> bool:
        """Free the KV cells of the least recently used parked sequence."""
        parked = [s for s in self.slots if not s.busy and s.tokens]
        if not parked:
            return False
        victim = min(parked, key=lambda s: s.last_used)
        self._save_state(victim)
        ll.llama_memory_seq_rm(self.mem, victim.seq, -1, -1)
        victim.tokens = []
        victim.session = None
        return True

    # -- one step -----------------------------------------------------------------

    def _step(self) -> None:
        for run in [r for r in self._active if r.cancelled]:
            self._finish(run, FinishReason.CANCELLED)
        entries = self._fill_batch()
        if not entries:
            self._flush(self._take_outputs())
            return
        start = time.monotonic()
        self._decode(entries)
        elapsed = time.monotonic() - start
        self.steps += 1
        for run, index, n_tokens in entries:
            if run not in self._active:
                continue  # failed while decoding (no KV room)
            self._advance(run, n_tokens)
            if index >= 0:
                self._sample(run, index)
        kv_cells = sum(len(s.tokens) for s in self.slots)
        self.observer.step(len(entries), len(self._active), kv_cells, elapsed)
        self._flush(self._take_outputs())

    def _fill_batch(self) -> list[tuple[_Run, int, int]]:
        """Fill the batch: one token per generating sequence, then prompt chunks.
        Returns (run, batch index with logits or -1, tokens added)."""
        b = self._batch
        cap = self.options.n_batch
        n = 0
        entries: list[tuple[_Run, int, int]] = []
        generating = [r for r in self._active if not r.prefilling and r.pending is not None]
        for run in generating:
            if not self._runnable(run):
                continue
            if n >= cap:
                break
            assert run.slot is not None and run.pending is not None
            self._put(b, n, run.pending, run.n_past, run.slot.seq, True)
            entries.append((run, n, 1))
            n += 1
        budget = cap - n
        if entries:
            budget = min(budget, self.options.prefill_chunk)
        for run in self._active:
            if not run.prefilling or budget <= 0:
                continue
            assert run.slot is not None
            prompt = run.req.prompt
            take = min(len(prompt) - run.n_past, budget)
            for i in range(take):
                pos = run.n_past + i
                last = pos == len(prompt) - 1
                self._put(b, n, prompt[pos], pos, run.slot.seq, last)
                n += 1
            entries.append((run, n - 1 if run.n_past + take == len(prompt) else -1, take))
            budget -= take
        b.n_tokens = n
        return entries

    @staticmethod
    def _put(b: ll.llama_batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits

    def _decode(self, entries: list[tuple[_Run, int, int]]) -> None:
        while True:
            ret = ll.llama_decode(self.ctx, self._batch)
            if ret == 0:
                return
            if ret != 1:
                raise RuntimeError(f"llama_decode failed with {ret}")
            # No KV room for this batch: evict parked sequences, then the youngest request.
            if self._evict_parked():
                continue
            youngest = max((r for r, _, _ in entries), key=lambda r: r.admitted)
            logger.warning("engine %s: KV cache full; failing request %s", self.name, youngest.id)
            self._out(youngest, KVCacheFull("the KV cache is full; retry later", retry_after=1.0))
            self._release(youngest)
            self._active.remove(youngest)
            remaining = [e for e in entries if e[0] is not youngest]
            entries[:] = remaining
            if not remaining:
                self._batch.n_tokens = 0
                return
            self._rebuild(remaining)

    def _rebuild(self, entries: list[tuple[_Run, int, int]]) -> None:
        """Refill the batch for `entries` only (after dropping a request)."""
        b = self._batch
        n = 0
        rebuilt: list[tuple[_Run, int, int]] = []
        for run, index, count in entries:
            assert run.slot is not None
            if not run.prefilling:
                assert run.pending is not None
                self._put(b, n, run.pending, run.n_past, run.slot.seq, True)
                rebuilt.append((run, n, 1))
                n += 1
                continue
            prompt = run.req.prompt
            for i in range(count):
                pos = run.n_past + i
                self._put(b, n, prompt[pos], pos, run.slot.seq, pos == len(prompt) - 1)
                n += 1
            rebuilt.append((run, n - 1 if index >= 0 else -1, count))
        b.n_tokens = n
        entries[:] = rebuilt

    def _advance(self, run: _Run, n_tokens: int) -> None:
        assert run.slot is not None
        if run.prefilling:
            prompt = run.req.prompt
            run.slot.tokens.extend(prompt[run.n_past : run.n_past + n_tokens])
            run.n_past += n_tokens
            if not run.prefilling:
                run.prefill_done = time.monotonic()
        else:
            assert run.pending is not None
            run.slot.tokens.append(run.pending)
            run.n_past += 1
            run.pending = None

    def _sample(self, run: _Run, index: int) -> None:
        assert run.sampler is not None
        token = run.sampler.sample(self.ctx, index)
        now = time.monotonic()
        if not run.generated:
            self.observer.first_token(now - run.submitted)
        else:
            self.observer.inter_token(now - run.last_token_at)
        run.last_token_at = now
        logprob: TokenLogprob | None = None
        if run.req.sampling.logprobs is not None:
            logprob = run.sampler.logprobs(self.ctx, index, token)
        run.generated.append(token)
        if self.model.is_eog(token) and not run.req.ignore_eos:
            self._emit(run, "", (token,), logprob)
            self._finish(run, FinishReason.STOP)
            return
        text = run.utf8.feed(self.model.piece(token))
        stop = None
        if run.stops is not None:
            text, stop = run.stops.feed(text)
        self._emit(run, text, (token,), logprob)
        if stop is not None:
            self._finish(run, FinishReason.STOP, stop)
        elif run.req.max_tokens is not None and len(run.generated) >= run.req.max_tokens:
            self._finish(run, FinishReason.LENGTH)
        elif run.n_past + 1 >= self.n_ctx:
            self._finish(run, FinishReason.LENGTH)
        else:
            run.pending = token

    def _emit(self, run: _Run, text: str, tokens: tuple[int, ...], logprob: TokenLogprob | None) -> None:
        if not text and not tokens:
            return
        self._out(run, Delta(text, tokens, (logprob,) if logprob is not None else ()))

    def _finish(self, run: _Run, reason: FinishReason, stop: str | None = None) -> None:
        tail = run.utf8.flush()
        if stop is None:
            if run.stops is not None:
                tail, late_stop = run.stops.feed(tail)
                if late_stop is None:
                    tail += run.stops.flush()
            if tail and reason is not FinishReason.CANCELLED:
                self._out(run, Delta(tail, ()))
        now = time.monotonic()
        admitted = run.admitted or now
        prefill_end = run.prefill_done or now
        n_prompt = len(run.req.prompt)
        usage = Usage(
            prompt_tokens=n_prompt,
            completion_tokens=len(run.generated),
            prompt_reused=run.reused,
            prompt_computed=min(run.n_past, n_prompt) - run.reused if run.admitted else 0,
            reuse_note=run.reuse_note,
        )
        timings = Timings(
            queued_s=admitted - run.submitted,
            prefill_s=max(0.0, prefill_end - admitted),
            decode_s=max(0.0, now - prefill_end) if run.prefill_done else 0.0,
            time_to_first_token_s=(prefill_end - run.submitted) if run.prefill_done else 0.0,
        )
        self._out(run, Done(reason, usage, timings, stop, tuple(run.generated)))
        self.observer.finished(usage, timings)
        self._release(run)
        if run in self._active:
            self._active.remove(run)

    def _release(self, run: _Run) -> None:
        """Park the run's sequence for reuse; free its sampler."""
        slot = run.slot
        if slot is not None:
            slot.busy = False
            slot.touch()
            run.slot = None
        if run.sampler is not None:
            run.sampler.free()
            run.sampler = None
        self._runs.pop(run.id, None)

    def _out(self, run: _Run, item: Event | BaseException) -> None:
        run.out.append(item)
        self._dirty[run.id] = run

    def _take_outputs(self) -> list[_Run]:
        runs = list(self._dirty.values())
        self._dirty.clear()
        return runs

    def _flush(self, runs: list[_Run]) -> None:
        """One wake-up per loop carrying every sequence's events of this step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, list[Event | BaseException]]]] = {}
        for run in runs:
            if not run.out:
                continue
            items, run.out = run.out, []
            run.stream.emitted += len(items)
            if run.stream.backlog > run.stream.high_water:
                run.stream.paused = True
            by_loop.setdefault(run.stream.loop, []).append((run.stream, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(streams.deliver, batch)
            except RuntimeError:
                pass  # that loop is closed: its readers are gone

    def _fail_all(self, error: BarrelError) -> None:
        runs = list(self._waiting) + list(self._active)
        self._waiting.clear()
        for run in runs:
            self._out(run, error)
            self._release(run)
        self._active.clear()
        self._runs.clear()
        self._flush(self._take_outputs())

    # -- embeddings ---------------------------------------------------------------

    def _embed(self, cmd: _Embed) -> None:
        try:
            result = self._compute_embeddings(cmd.inputs, cmd.normalize)
        except BarrelError as exc:
            cmd.loop.call_soon_threadsafe(_reject, cmd.future, exc)
            return
        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result)

    def _compute_embeddings(self, inputs: list[list[int]], normalize: bool) -> list[list[float]]:
        import numpy as np

        out: list[list[float]] = []
        b = self._batch
        cap = min(self.options.n_batch, self.options.n_ubatch)
        i = 0
        while i < len(inputs):
            ll.llama_memory_clear(self.mem, True)
            n = 0
            seqs: list[int] = []
            while i < len(inputs) and len(seqs) < self.options.n_seq_max:
                toks = inputs[i]
                if n + len(toks) > cap:
                    break
                seq = len(seqs)
                for pos, tok in enumerate(toks):
                    self._put(b, n, tok, pos, seq, True)
                    n += 1
                seqs.append(seq)
                i += 1
            b.n_tokens = n
            ret = ll.llama_decode(self.ctx, b)
            if ret != 0:
                raise KVCacheFull(f"embedding batch failed ({ret})")
            for seq in seqs:
                ptr = ll.llama_get_embeddings_seq(self.ctx, seq)
                if not ptr:
                    raise BarrelError("the model produced no pooled embedding")
                vec = np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).astype(np.float64)
                if normalize:
                    norm = float(np.linalg.norm(vec))
                    if norm > 0:
                        vec = vec / norm
                out.append(vec.tolist())
        ll.llama_memory_clear(self.mem, True)
        return out

    # -- teardown -------------------------------------------------------------------

    def _free(self) -> None:
        if getattr(self, "ctx", None):
            for run in list(self._active):
                if run.sampler is not None:
                    run.sampler.free()
            ll.llama_batch_free(self._batch)
            ll.llama_free(self.ctx)
            self.ctx = None
            for adapter in self._loras:
                ll.llama_adapter_lora_free(adapter)
            self._loras = []


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
