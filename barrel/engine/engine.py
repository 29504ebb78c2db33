"""The engine: one thread owning one llama_context, with continuous batching.

Thread affinity: `submit`, `cancel`, `embed`, `stop`, `inject_fault` and the tokenizer
helpers may be called from any thread; they only put commands in the inbox. Everything
else runs in the engine thread, the only code that touches the context.

Each step is one `llama_decode` holding the next token of every generating sequence plus
chunks of waiting prompts (at most `prefill_chunk` prompt tokens while others generate),
so a long prompt never freezes the streams already running. New requests join between
steps; cancellation is seen before every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import llama_cpp as ll
import numpy as np

from barrel.engine import stream as streams
from barrel.engine.context import (
    Batch,
    EngineOptions,
    apply_loras,
    effective_options,
    new_context,
    set_lora_scales,
)
from barrel.engine.draft import DraftModel, Want
from barrel.engine.embed import compute_embeddings
from barrel.engine.errors import (
    EngineCrashed,
    EngineStopped,
    InvalidGrammar,
    KVCacheFull,
    PromptTooLong,
)
from barrel.engine.kvcache import Slot, StateCache
from barrel.engine.model import LlamaModel, ModelOptions
from barrel.engine.run import Run
from barrel.engine.sampler import LogitRows, Sampler
from barrel.engine.slots import SlotManager, runs_of
from barrel.engine.speculate import NgramDrafter, align_drafts
from barrel.engine.stream import Stream
from barrel.engine.types import Done, Event, FinishReason, GenerationRequest, RequestId
from barrel.engine.vision import Projector, is_placeholder, load_projector
from barrel.errors import BarrelError, InvalidRequest
from barrel.futures import Reply, ToLoop

logger = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Receives the engine's measurements, in the engine thread (see barrel.metrics)."""

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, done: Done) -> None: ...

    def drafted(self, drafted: int, accepted: int) -> None:
        """Speculative decoding: draft tokens verified in a step, and how many were kept."""

    def next_turn(self, tokens: int) -> None:
        """A finished sequence was extended with its template's next-turn tokens."""

    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        """After every turn of the loop that did work, decoded or not (a cancelled
        sequence ends without a decode). `busy_cells`: those of running sequences."""


class _NoObserver:
    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        pass

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        pass

    def first_token(self, seconds: float) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def finished(self, done: Done) -> None:
        pass

    def drafted(self, drafted: int, accepted: int) -> None:
        pass

    def next_turn(self, tokens: int) -> None:
        pass


# -- inbox commands ---------------------------------------------------------------


@dataclass(frozen=True)
class _Submit:
    run: Run


@dataclass(frozen=True)
class _Cancel:
    id: RequestId


@dataclass(frozen=True)
class _Embed:
    inputs: list[list[int]]
    normalize: bool
    reply: Reply[list[list[float]]]


@dataclass(frozen=True)
class _Pin:
    tokens: list[int]
    reply: Reply[int]
    scope: str = ""


@dataclass
class _PinJob:
    """Prefilling a pinned prefix: low priority, no logits, no output."""

    slot: Slot
    tokens: list[int]
    reply: Reply[int]
    n_past: int = 0


class _Turn(NamedTuple):
    """A finished conversation's next-turn tokens, to decode into its slot once idle.
    The slot may meanwhile be reused, or take a moved sequence, and end up as long as
    it was: the last tokens it held tell whether it still holds this conversation."""

    slot: Slot
    length: int  # the slot's tokens when the answer ended
    ended: tuple[int, ...]  # the last TURN_TAIL of them
    tokens: list[int]
    when: float  # time.monotonic() from which they may be decoded

    @staticmethod
    def tail(slot: Slot) -> tuple[int, ...]:
        return tuple(slot.tokens[-TURN_TAIL:])

    def holds(self, slot: Slot) -> bool:
        return len(slot.tokens) == self.length and _Turn.tail(slot) == self.ended


# How many of a finished conversation's last tokens tell it from another of its length
TURN_TAIL = 32


@dataclass(frozen=True)
class _Fault:
    error: BaseException


class _Wake:
    """A paused stream's reader caught up: re-evaluate."""


class _Stop:
    pass


# The largest LoRA scale a request may set (llama-server takes any float; a huge one
# only makes noise).
LORA_SCALE_MAX = 100.0

# Prompt tokens per step for a request that wants their logprobs (each one's logits are
# a vocabulary of floats: 64 x 152k x 4 bytes = 39 MB of output buffer for Qwen).
PROMPT_LOGPROB_CHUNK = 64

# llama_decode's status when its abort callback stopped it
ABORTED = 2

# (run, batch index of its logits or -1, tokens it put in the batch)
Entry = tuple[Run, int, int]

# Steps a gap between running sequences (a KV stream each) is left for a new request to
# fill before a running sequence moves into it (`SlotManager.close_gap`): a request that
# comes goes there at no cost, and the move copies a sequence's cells.
GAP_STEPS = 2
GAP_RETRY_STEPS = 64  # after a gap could not be closed

# Steps with fewer prompt rows do not time a prompt row (`Engine._prefill_budget`): a
# step of a few rows costs a pass over the weights, whatever its rows.
MIN_TIMED_ROWS = 64


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
        self.options = opts = effective_options(options or EngineOptions())
        self.name = name
        self.observer: EngineObserver = observer or _NoObserver()
        self.on_crash = on_crash
        self.n_ctx = min(opts.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else opts.n_ctx
        self.ctx: Any = new_context(model, opts, self.n_ctx)
        try:
            self._loras = apply_loras(model, self.ctx, opts.loras)
            self.projector: Projector | None = None
            if opts.mmproj is not None:
                self.projector = load_projector(
                    opts.mmproj,
                    model,
                    threads=opts.threads or (os.cpu_count() or 1),
                    use_gpu=model.options.n_gpu_layers != 0,
                )
        except BaseException:
            for adapter in getattr(self, "_loras", ()):
                ll.llama_adapter_lora_free(adapter)
            ll.llama_free(self.ctx)
            raise
        # LoRA scales now set on the context, and the step each setting last ran
        self._lora_default = tuple(lo.scale for lo in opts.loras)
        self._lora_now = self._lora_default
        self._lora_served: dict[tuple[float, ...], int] = {}
        cache = StateCache(
            opts.state_cache_bytes, opts.state_cache_dir, opts.state_cache_disk_bytes
        )
        self.kv = SlotManager(
            self.ctx,
            model,
            opts.n_seq_max,
            opts.max_pins,
            cache,
            per_sequence=opts.kv_per_sequence and not opts.embedding,
        )
        self._batch = Batch(max(opts.n_batch, 1))
        self._rows = LogitRows(model.n_vocab)  # views of the logits rows, shared by samplers
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        # Set by the owner (any thread) before it decides to stop the engine: callers that
        # cache the engine see it and go back to the owner instead (guides/lifecycle.md).
        self.closing = False
        # Held while checking liveness and queueing, and while the dying thread drains its
        # inbox: no request can be queued after the last drain and hang.
        self._gate = threading.Lock()
        self._waiting: deque[Run] = deque()
        self._active: list[Run] = []
        # Open sessions that may submit a request (`expect`); the engine thread only reads
        # it: an idle engine gathers a first step only while one of them has not arrived.
        self._expected = 0
        self._runs: dict[RequestId, Run] = {}
        self._dirty: dict[RequestId, Run] = {}  # runs with events to deliver this step
        self._pinning: list[_PinJob] = []
        # finished sequences to extend with their template's next-turn tokens once idle
        # for next_turn_delay_s
        self._turns: deque[_Turn] = deque(maxlen=opts.n_seq_max)
        self._pin_entries: list[tuple[_PinJob, int]] = []
        self._prompt_rows = 0  # prompt rows in the batch being built (_fill_batch)
        self._row_s = 0.0  # seconds a row of steps with prompt rows costs lately
        self.crashed: BaseException | None = None
        self.steps = 0  # decode steps done
        self._gap_steps = 0  # steps the running sequences' ids have not been one run
        self.gap_moves = 0  # running sequences moved to join the others (engine thread)
        self.turn_steps = 0  # idle decodes of next-turn tokens (_continue_turns)
        self.turn_aborts = 0  # ... given up for a request that came meanwhile
        self.turns_dropped = 0  # ... not decoded: their slot was taken, changed or full
        # Set by any thread that queues work: an idle decode under way stops at its next
        # graph node (llama.cpp's abort callback, armed only for idle decodes).
        self._interrupt = False
        self._abort_check = ll.ggml_abort_callback(lambda _data: self._interrupt)
        # a reranker's pooled output is its classifier's scores, not a hidden state
        self.ranks = bool(opts.embedding) and (
            ll.llama_pooling_type(self.ctx) == ll.LLAMA_POOLING_TYPE_RANK
        )
        self._pooled = ll.llama_model_n_cls_out(model.handle) if self.ranks else model.n_embd
        # partial KV removal (rejected drafts) needs a plain attention cache
        plain = not (model.swa or model.recurrent)
        self._speculate = opts.speculation == "ngram" and opts.draft_max > 0 and plain
        self._drafter: DraftModel | None = None
        if opts.draft_model is not None and plain and not opts.embedding:
            try:
                draft = LlamaModel.load(opts.draft_model, ModelOptions(model.options.n_gpu_layers))
                try:
                    self._drafter = DraftModel(draft, model, opts, self.n_ctx)
                except BaseException:
                    draft.free()
                    raise
            except BaseException:
                self._free()
                raise
            self._speculate = False  # the draft model drafts instead
            logger.info("engine %s: drafting with %s", name, opts.draft_model.name)

    @property
    def cache(self) -> StateCache:
        return self.kv.cache

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._main, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is in flight, end the thread, free the context."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine %s did not stop within %ss", self.name, timeout)
                return
        self._free()

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    # -- API (any thread) -----------------------------------------------------------

    def submit(self, req: GenerationRequest) -> Stream:
        """Queue a generation; read the returned stream on the calling event loop. Bad
        input raises here, before anything is queued."""
        to_loop = ToLoop()
        if self.options.embedding:
            raise InvalidRequest("this model is loaded for embeddings only")
        if not req.prompt:
            raise PromptTooLong("the prompt is empty")
        if len(req.prompt) >= self.n_ctx:
            raise PromptTooLong(
                f"the prompt has {len(req.prompt)} tokens; the context holds {self.n_ctx}",
                tokens=len(req.prompt),
                limit=self.n_ctx,
            )
        req = self._with_lora(req)
        self._check_media(req)
        # Built in the caller's thread (it needs the vocabulary only): a bad grammar fails
        # the request before it is queued.
        sampler = Sampler(self.model, req.sampling, self.n_ctx, self._rows)
        rid = RequestId(next(self._ids))
        s = Stream(rid, to_loop, self.cancel, self._resume)
        with self._gate:
            if not self.alive:
                sampler.free()
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._queue_work(_Submit(Run(rid, req, s, sampler)))
        return s

    def expect(self, sessions: int) -> None:
        """`sessions` more (negative: fewer) open sessions that may submit a request soon
        (any thread). While more are open than requests have arrived, an idle engine
        holds its first step up to `gather_s` for them; a lone request starts at once."""
        with self._gate:
            self._expected += sessions

    @property
    def expected(self) -> int:
        """Open sessions that may submit a request (`expect`)."""
        return self._expected

    def _with_lora(self, req: GenerationRequest) -> GenerationRequest:
        """`req` with its LoRA scales checked, and a KV scope of their own when they
        differ from the load-time scales (cells computed under other adapters are not
        this request's)."""
        if req.lora is None:
            return req
        n = len(self._lora_default)
        if len(req.lora) != n:
            raise InvalidRequest(f"lora: this model has {n} adapters", param="lora")
        if any(not math.isfinite(s) or abs(s) > LORA_SCALE_MAX for s in req.lora):
            raise InvalidRequest(
                f"lora: scales must be finite, at most {LORA_SCALE_MAX:g} in size", param="lora"
            )
        if req.lora == self._lora_default:
            return dataclasses.replace(req, lora=None)
        tag = ",".join(f"{s:g}" for s in req.lora)
        return dataclasses.replace(req, scope=f"{req.scope}|lora={tag}")

    def _check_media(self, req: GenerationRequest) -> None:
        """A prompt's image placeholders must all be images this request brought, and
        never end it (the first sample needs a text token's logits)."""
        holes = {t for t in req.prompt if is_placeholder(t)}
        if not holes and not req.media:
            return
        if self.projector is None:
            raise InvalidRequest("this model reads text only; images are not supported")
        if holes - {m.token for m in req.media}:
            raise InvalidRequest("the prompt has token ids outside the vocabulary")
        if is_placeholder(req.prompt[-1]):
            raise InvalidRequest("a prompt may not end with an image")
        if req.prompt_logprobs:
            raise InvalidRequest("prompt logprobs are not available for prompts with images")

    def _lora_of(self, run: Run) -> tuple[float, ...]:
        return run.req.lora if run.req.lora is not None else self._lora_default

    def _step_lora(self) -> tuple[float, ...]:
        """The LoRA scales of this step: the setting that has waited longest among the
        runnable sequences (pinned prefixes are computed under the load-time scales)."""
        wanted = {self._lora_of(r) for r in self._active if self._runnable(r)}
        if self._pinning:
            wanted.add(self._lora_default)
        if self._lora_served.keys() - wanted:  # clients choose the scales: keep it bounded
            self._lora_served = {k: v for k, v in self._lora_served.items() if k in wanted}
        if not wanted or wanted == {self._lora_now}:
            return self._lora_now
        return min(wanted, key=lambda scales: self._lora_served.get(scales, -1))

    def cancel(self, request_id: RequestId) -> None:
        self._inbox.put(_Cancel(request_id))

    def _resume(self) -> None:
        self._inbox.put(_Wake())

    def embed(
        self,
        inputs: list[list[int]],
        *,
        normalize: bool = True,
        truncate: bool = False,
    ) -> asyncio.Future[list[list[float]]]:
        """Pooled embeddings of `inputs` (token lists). An input longer than the batch
        is cut to fit with `truncate`, else refused. Await the result on the calling
        event loop."""
        if not self.options.embedding:
            raise InvalidRequest("this model is not loaded for embeddings")
        limit = min(self.n_ctx, self.options.n_ubatch, self.options.n_batch)
        if truncate:
            inputs = [toks[:limit] for toks in inputs]
        for toks in inputs:
            if not toks or len(toks) > limit:
                raise PromptTooLong(f"an input has {len(toks)} tokens; 1 to {limit} are allowed")
        reply: Reply[list[list[float]]] = Reply()
        with self._gate:
            if not self.alive:
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._queue_work(_Embed(inputs, normalize, reply))
        return reply.future

    def pin(self, tokens: list[int], scope: str = "") -> asyncio.Future[int]:
        """Keep `tokens` (a static system + tools prefix) prefilled in a pinned sequence;
        requests of `scope` starting with it share its KV cells instead of prefilling them.
        Resolves to the number of tokens pinned (0 if no pin sequence is configured)."""
        if not tokens or len(tokens) >= self.n_ctx:
            raise PromptTooLong(f"a pinned prefix must have 1 to {self.n_ctx - 1} tokens")
        reply: Reply[int] = Reply()
        with self._gate:
            if not self.alive:
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._queue_work(_Pin(list(tokens), reply, scope))
        return reply.future

    def _queue_work(self, cmd: _Submit | _Embed | _Pin) -> None:
        """Queue work for the engine thread and stop its idle decode, if one is under
        way (`_decode_idle`): the flag is set after the command is in the inbox."""
        self._inbox.put(cmd)
        self._interrupt = True

    def inject_fault(self, error: BaseException) -> None:
        """Tests only: make the engine thread raise `error` before its next step."""
        self._inbox.put(_Fault(error))

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    def count_tokens(self, text: str) -> int:
        return len(self.model.tokenize(text))

    # -- the loop (engine thread) ---------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self._active and not self._pinning
                self._drain(block=not self._has_work(), timeout=self._turn_wait())
                if idle and self._waiting and self.options.gather_s > 0:
                    self._gather(self.options.gather_s)
                if self._stopped.is_set():
                    break
                self._admit()
                if self._active or self._pinning:
                    self._step()
                elif self._turns and not self._waiting and self._turn_wait() == 0.0:
                    self._continue_turns()
            self._fail_all(EngineStopped(f"engine {self.name} stopped", retry_after=1.0))
        except BaseException as exc:
            logger.exception("engine %s crashed", self.name)
            self.crashed = exc
            self._stopped.set()
            self._fail_all(EngineCrashed(f"engine {self.name} crashed: {exc}", retry_after=1.0))
            if self.on_crash is not None:
                try:
                    self.on_crash(exc)
                except Exception:
                    logger.exception("engine %s: on_crash callback failed", self.name)
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
                self._waiting.append(cmd.run)
            elif isinstance(cmd, _Embed):
                cmd.reply.reject(error)
        if self._waiting:
            self._fail_all(error)

    def _turn_wait(self) -> float:
        """Seconds until the newest finished sequence may get its next-turn tokens (how
        long to block for commands meanwhile)."""
        if not self._turns:
            return 1.0
        return max(0.0, min(1.0, self._turns[-1].when - time.monotonic()))

    def _has_work(self) -> bool:
        if self._pinning or (self._waiting and self.kv.free_slots()):
            return True
        if self._turns and self._turn_wait() == 0.0:
            return True
        return any(self._runnable(r) for r in self._active)

    @staticmethod
    def _runnable(run: Run) -> bool:
        """False while the run's reader is too far behind (see barrel.engine.stream)."""
        s = run.stream
        if s.paused and s.backlog <= s.high_water // 2:
            s.paused = False
        return not s.paused

    def _drain(self, *, block: bool, timeout: float = 1.0) -> None:
        try:
            cmd = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _gather(self, seconds: float) -> None:
        """Requests that arrive within `seconds` join the first step, while sessions are
        open whose request has not arrived (`expect`)."""
        deadline = time.monotonic() + seconds
        while self._coming() and (left := deadline - time.monotonic()) > 0:
            try:
                self._handle(self._inbox.get(timeout=left))
            except queue.Empty:
                return

    def _coming(self) -> bool:
        """More sessions are open than runs are here: a request is on its way."""
        return self._expected > len(self._waiting) + len(self._active)

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Submit):
            self._runs[cmd.run.id] = cmd.run
            self._waiting.append(cmd.run)
        elif isinstance(cmd, _Cancel):
            run = self._runs.get(cmd.id)
            if run is None:
                return
            run.cancelled = True
            if run in self._waiting:
                self._waiting.remove(run)
                self._finish(run, FinishReason.CANCELLED)
                self._flush()
        elif isinstance(cmd, _Embed):
            self._embed(cmd)
        elif isinstance(cmd, _Pin):
            slot = self.kv.pin_slot(cmd.tokens, cmd.scope)
            if slot is None:
                pinned = len(cmd.tokens) if self.kv.pins else 0
                cmd.reply.resolve(pinned)
            else:
                self._pinning.append(_PinJob(slot, cmd.tokens, cmd.reply))
        elif isinstance(cmd, _Fault):
            raise cmd.error
        elif isinstance(cmd, _Stop):
            self._stopped.set()

    def _admit(self) -> None:
        while self._waiting:
            run = self._waiting[0]
            choice = self.kv.choose(run.req.prompt, run.req.session, run.req.scope)
            if choice is None:
                break
            self._waiting.popleft()
            slot, lcp = choice
            reuse = not run.req.prompt_logprobs
            run.admitted = time.monotonic()
            # Parked sequences leave before this one's cells are placed: a state restored
            # from the cache then lands in the cells they held, low in the KV, not above
            # them (every step attends up to the highest used cell), and a restore that
            # needs more contiguous cells than they left free still succeeds.
            running = sum(len(r.req.prompt) + len(r.generated) for r in self._active)
            self.kv.shed_parked(running + len(run.req.prompt), taking=slot)
            run.n_past, run.reuse_note = self.kv.attach(
                slot,
                run.req.prompt,
                lcp,
                run.req.session,
                reuse=reuse,
                scope=run.req.scope,
            )
            self._image_start(run, slot)
            # the whole prompt reused with the logits its prefill left (attach)
            logits = self.kv.prompt_logits(slot, run.req.prompt, run.n_past) if reuse else None
            run.reused = run.n_past
            run.slot = slot
            self._active.append(run)
            if logits is not None and not run.prefilling:
                self._first_from_kept(run, logits)
        self._flush()

    def _first_from_kept(self, run: Run, logits: np.ndarray) -> None:
        """The prompt is whole in the slot with the logits that followed it: the first
        token comes from them, without a decode, and is the token a cold run samples."""
        run.prefill_done = time.monotonic()
        if run.req.max_tokens == 0:
            self._finish(run, FinishReason.LENGTH)
        else:
            self._sample(run, -1, logits)

    def _image_start(self, run: Run, slot: Slot) -> None:
        """KV reuse that ends inside an image goes back to the image's start: an image
        is evaluated whole."""
        prompt, n = run.req.prompt, run.n_past
        if n == 0 or n >= len(prompt) or not is_placeholder(prompt[n]):
            return
        start = n
        while start > 0 and prompt[start - 1] == prompt[n]:
            start -= 1
        if start < n:
            ll.llama_memory_seq_rm(self.kv.mem, slot.seq, start, -1)
            del slot.tokens[start:]
            run.n_past = start

    def _images(self, lora: tuple[float, ...]) -> None:
        """Evaluate the image each prefilling sequence has reached (engine thread; the
        projector decodes its embeddings into the sequence). No KV room: parked
        sequences go first, then the request fails, as for tokens."""
        for run in list(self._active):
            if not run.prefilling or run.slot is None or self._lora_of(run) != lora:
                continue
            token = run.req.prompt[run.n_past]
            if not is_placeholder(token):
                continue
            assert self.projector is not None  # submit checked it
            media = next(m for m in run.req.media if m.token == token)
            n_pos = 0
            seq = run.slot.seq
            while True:
                try:
                    n_pos = self.projector.evaluate(
                        self.ctx, media, run.n_past, seq, self.options.n_batch
                    )
                    break
                except RuntimeError:
                    ll.llama_memory_seq_rm(self.kv.mem, seq, run.n_past, -1)
                    if not (self.kv.evict_lru() or self.kv.evict_pin()):
                        self._out(run, KVCacheFull("no KV room for the image", retry_after=1.0))
                        self._release(run)
                        break
            if run.slot is not None:
                run.slot.tokens.extend([token] * n_pos)
                run.n_past += n_pos

    # -- one step -----------------------------------------------------------------

    def _step(self) -> None:
        for run in [r for r in self._active if r.cancelled]:
            self._finish(run, FinishReason.CANCELLED)
        if self.kv.per_sequence:
            self._close_gap()
        entries = self._fill_batch()
        elapsed = -1.0
        if entries or self._pin_entries:
            start = time.monotonic()
            entries = self._decode(entries)
            elapsed = time.monotonic() - start
            self.steps += 1
            if self._prompt_rows >= MIN_TIMED_ROWS:
                rate = elapsed / self._batch.n
                self._row_s = rate if self._row_s <= 0 else (self._row_s + rate) / 2
            for run, index, n_tokens in entries:
                if run.logit_rows:
                    self._prompt_logprobs(run)
                prefilled = run.prefilling
                self._advance(run, n_tokens)
                if index >= 0 and run.req.max_tokens == 0:
                    self._finish(run, FinishReason.LENGTH)  # the prompt only (its logprobs)
                elif index >= 0:
                    if prefilled:
                        self._keep_logits(run, index)
                    seq = run.slot.seq if run.slot is not None else -1
                    self._sample(run, index)
                    if run.draft:
                        self._verify_draft(run, index, seq)
            self._advance_pins()
        cells = self.kv.kv_cells()
        if elapsed >= 0:
            self.observer.step(self._batch.n, len(self._active), cells, elapsed)
        self.observer.occupancy(len(self._active), cells, self.kv.busy_cells())
        self._flush()

    def _fill_batch(self) -> list[Entry]:
        """One token for each generating sequence, then prompt chunks in arrival order."""
        b = self._batch
        b.clear()
        entries: list[Entry] = []
        lora = self._step_lora()
        if lora != self._lora_now:
            set_lora_scales(self.ctx, self._loras, lora)
            self._lora_now = lora
        self._lora_served[lora] = self.steps
        for run in self._active:
            run.logit_rows.clear()  # a rebuilt batch (KV full) must not count rows twice
        generating = [
            run
            for run in self._active
            if not run.prefilling
            and run.pending is not None
            and self._runnable(run)
            and self._lora_of(run) == lora
        ]
        guesses = self._guesses(generating)
        # Plan the step (each generating sequence's pending token and draft, then prompt
        # chunks in arrival order, then pinned prefixes), align it, then fill the batch.
        room = b.capacity
        planned: list[Run] = []
        for run in generating:
            if room <= 0:
                break
            assert run.slot is not None
            room -= 1
            if self._drafter is not None:
                run.draft = guesses.get(run.slot.seq, [])[:room]
            else:
                run.draft = self._draft(run, room)
            room -= len(run.draft)
            planned.append(run)
        budget = min(room, self._prefill_budget()) if planned else room
        if self.projector is not None:
            self._images(lora)
        chunks: list[tuple[Run, int]] = []
        for run in self._active:
            if not run.prefilling or budget <= 0 or self._lora_of(run) != lora:
                continue
            take = self._chunk(run, budget)
            if take:
                chunks.append((run, take))
                budget -= take
        self._prompt_rows = sum(take for _, take in chunks)
        pins: list[tuple[_PinJob, int]] = []
        for job in self._pinning:
            if budget <= 0 or lora != self._lora_default:
                break
            take = min(len(job.tokens) - job.n_past, budget)
            pins.append((job, take))
            budget -= take
        if self.kv.per_sequence:
            self._one_ubatch(planned, chunks)
        n = len(planned) + sum(len(r.draft) for r in planned) + sum(t for _, t in chunks + pins)
        if not (self.kv.per_sequence and len(planned) > 1):
            align_drafts([r.draft for r in planned], n)
        for run in planned:
            assert run.slot is not None
            assert run.pending is not None
            index = b.add(run.pending, run.n_past, run.slot.seq, True)
            for j, token in enumerate(run.draft):
                b.add(token, run.n_past + 1 + j, run.slot.seq, True)
            entries.append((run, index, 1))
        for run, take in chunks:
            assert run.slot is not None
            prompt, rows = run.req.prompt, run.req.prompt_logprobs
            index = -1
            for pos in range(run.n_past, run.n_past + take):
                last = pos == len(prompt) - 1
                i = b.add(prompt[pos], pos, run.slot.seq, last or rows)
                if rows and not last:
                    run.logit_rows.append((i, pos))
                if last:
                    index = i
            entries.append((run, index, take))
        self._pin_entries = pins
        for job, take in pins:
            for pos in range(job.n_past, job.n_past + take):
                b.add(job.tokens[pos], pos, job.slot.seq, False)
        if not entries and self._pin_entries:
            # Only pins in this batch: llama_decode needs one output somewhere.
            b.raw.logits[b.n - 1] = True
        return entries

    def _prefill_budget(self) -> int:
        """Prompt rows a step takes beside generating sequences: `prefill_chunk`, or
        with `prefill_step_s` as many as take about that long at the rate rows of such
        steps have cost lately (a step's cost per row grows with the cells it attends
        to), never fewer than `prefill_chunk`."""
        opts = self.options
        if opts.prefill_step_s <= 0 or self._row_s <= 0:
            return opts.prefill_chunk
        return max(opts.prefill_chunk, int(opts.prefill_step_s / self._row_s))

    def _close_gap(self) -> None:
        """Join the running sequences' ids into one run (one micro-batch a step) once a
        gap among them has lasted GAP_STEPS steps. Not with a draft model, whose own
        context keeps each sequence under its id. A parked conversation displaced with
        its next turn queued loses only that idle prefill (the entry no longer matches
        the slot); its next turn comes from the state cache."""
        if self._drafter is not None or runs_of({r.slot.seq for r in self._active if r.slot}) <= 1:
            self._gap_steps = 0
            return
        self._gap_steps += 1
        if self._gap_steps < GAP_STEPS:
            return
        moved = self.kv.close_gap()
        if moved is None:
            self._gap_steps = -GAP_RETRY_STEPS  # no free slot joins them, or a copy failed
            return
        src, dst = moved
        for run in self._active:
            if run.slot is src:
                run.slot = dst
        self._gap_steps = 0
        self.gap_moves += 1
        logger.debug(
            "engine %s: sequence %d moved to %d, beside the others", self.name, src.seq, dst.seq
        )

    @staticmethod
    def _one_ubatch(planned: list[Run], chunks: list[tuple[Run, int]]) -> None:
        """With a KV stream per sequence llama.cpp splits a step into micro-batches of
        consecutive sequence ids with as many tokens each, and every micro-batch reads
        all the weights again: generating sequences go in sequence order, and when they
        all draft, with drafts of one length (the shortest: one micro-batch); when some
        do not, only the longest draft stays (one more micro-batch, for its tokens)."""
        planned.sort(key=lambda r: r.slot.seq if r.slot is not None else -1)
        chunks.sort(key=lambda c: c[0].slot.seq if c[0].slot is not None else -1)
        if len(planned) > 1:
            shortest = min(len(r.draft) for r in planned)
            longest = max(planned, key=lambda r: len(r.draft))
            for run in planned:
                if shortest or run is not longest:
                    del run.draft[shortest:]

    @staticmethod
    def _chunk(run: Run, budget: int) -> int:
        """How many of `run`'s prompt tokens the step takes: up to `budget`, never past
        an image (evaluated on its own), fewer with prompt logprobs (a vocabulary of
        logits per token: the output buffer stays small)."""
        prompt = run.req.prompt
        take = min(len(prompt) - run.n_past, budget)
        if run.req.media:  # text up to the next image (evaluated next step)
            take = next(
                (
                    i - run.n_past
                    for i in range(run.n_past, run.n_past + take)
                    if is_placeholder(prompt[i])
                ),
                take,
            )
        if run.req.prompt_logprobs:
            take = min(take, PROMPT_LOGPROB_CHUNK)
        return take

    def _decode(self, entries: list[Entry]) -> list[Entry]:
        """Decode the batch. With no KV room: evict parked sequences, then idle pinned
        prefixes, then fail the youngest request, rebuilding the batch each time.
        Returns the entries decoded."""
        while True:
            ret = ll.llama_decode(self.ctx, self._batch.raw)
            if ret == 0:
                return entries
            if ret != 1:
                raise RuntimeError(f"llama_decode failed with status {ret}")
            if self.kv.evict_lru() or self.kv.evict_pin():
                pass
            elif entries:
                youngest = max((r for r, _, _ in entries), key=lambda r: r.admitted)
                logger.warning(
                    "engine %s: KV cache full; failing request %s", self.name, youngest.id
                )
                self._out(
                    youngest, KVCacheFull("the KV cache is full; retry later", retry_after=1.0)
                )
                self._release(youngest)
            else:
                self._fail_pins(KVCacheFull("no KV room for the pinned prefix", retry_after=1.0))
            entries = self._fill_batch()
            if not entries and not self._pin_entries:
                return []

    def _room(self, run: Run, room: int) -> int:
        """Draft tokens `run` can verify: within `room`, the context and its token limit."""
        room = min(room, self.n_ctx - run.n_past - 2)
        if run.req.max_tokens is not None:
            room = min(room, run.req.max_tokens - len(run.generated) - 1)
        return room

    def _guesses(self, generating: list[Run]) -> dict[int, list[int]]:
        """The draft model's tokens for the generating sequences (none with images: the
        draft model cannot read them), by sequence id."""
        if self._drafter is None:
            return {}
        k = self.options.draft_model_tokens
        wants = [
            Want(run.slot.seq, [*run.req.prompt, *run.generated], self._room(run, k))
            for run in generating
            if run.slot is not None and not run.req.media
        ]
        return self._drafter.draft(wants, k)

    def _draft(self, run: Run, room: int) -> list[int]:
        """Draft tokens to verify after `run`'s pending token (barrel.engine.speculate),
        within the batch's `room`, the context and the request's token limit."""
        if not self._speculate:
            return []
        history = len(run.req.prompt) + len(run.generated)
        if run.drafter is None:
            opts = self.options
            run.drafter = NgramDrafter(
                [*run.req.prompt, *run.generated], opts.draft_ngram, opts.draft_max
            )
        elif len(run.drafter.history) < history:
            run.drafter.extend(run.generated[len(run.drafter.history) - history :])
        draft = run.drafter.draft(self._room(run, room))
        if run.req.media:  # never an image's placeholder
            draft = list(itertools.takewhile(lambda t: not is_placeholder(t), draft))
        return draft

    def _verify_draft(self, run: Run, index: int, seq: int) -> None:
        """Keep the draft tokens while each equals the token sampled before it (the
        token at `index + j` was sampled from the logits of draft token j-1), then drop
        the rejected ones' KV cells."""
        draft, run.draft = run.draft, []
        kept = 0
        for j, token in enumerate(draft):
            if run.slot is None or run.pending != token:
                break
            run.slot.tokens.append(token)  # already decoded at this position
            run.n_past += 1
            run.pending = None
            kept += 1
            self._sample(run, index + 1 + j)
        ll.llama_memory_seq_rm(self.kv.mem, seq, run.n_past, -1)
        if run.drafter is not None:
            run.drafter.record(len(draft), kept)
        self.observer.drafted(len(draft), kept)

    def _advance(self, run: Run, n_tokens: int) -> None:
        assert run.slot is not None
        if run.prefilling:
            start = run.n_past
            run.slot.tokens.extend(run.req.prompt[start : start + n_tokens])
            run.n_past += n_tokens
            if not run.prefilling:
                run.prefill_done = time.monotonic()
        else:
            assert run.pending is not None
            run.slot.tokens.append(run.pending)
            run.n_past += 1
            run.pending = None

    def _advance_pins(self) -> None:
        for job, n_tokens in self._pin_entries:
            job.slot.tokens.extend(job.tokens[job.n_past : job.n_past + n_tokens])
            job.n_past += n_tokens
            if job.n_past == len(job.tokens):
                self._pinning.remove(job)
                job.slot.busy = False
                job.slot.touch()
                job.reply.resolve(len(job.tokens))
        self._pin_entries = []

    def _prompt_logprobs(self, run: Run) -> None:
        """The logprob of each prompt token given those before it, from this step's rows."""
        prompt = run.req.prompt
        for i, pos in run.logit_rows:
            run.prompt_logprobs.append(run.sampler.logprobs(self.ctx, i, prompt[pos + 1]))
        run.logit_rows.clear()

    def _keep_logits(self, run: Run, index: int) -> None:
        """Keep the logits of the prompt's last token with the slot (a copy: the
        context's buffer is reused by the next decode)."""
        if run.slot is not None and not run.req.prompt_logprobs:
            row = self._rows(self.ctx, index)
            run.slot.prompt_logits = (tuple(run.req.prompt), row.copy())

    def _sample(self, run: Run, index: int, logits: np.ndarray | None = None) -> None:
        """Sample `run`'s next token from batch row `index`, or from kept `logits`."""
        started = time.monotonic()
        if logits is None:
            token = run.sampler.sample(self.ctx, index)
        else:
            token = run.sampler.sample_from(logits)
        now = time.monotonic()
        budget = self.options.grammar_sample_s
        if run.req.sampling.grammar and budget and now - started > budget:
            # A grammar this slow would stall every other sequence of the batch: end it.
            self._out(
                run,
                InvalidGrammar(
                    f"sampling under this grammar took {now - started:.1f}s a token; "
                    f"at most {budget:g}s"
                ),
            )
            self._release(run)
            return
        if run.generated:
            self.observer.inter_token(now - run.last_token_at)
        else:
            self.observer.first_token(now - run.submitted)
        run.last_token_at = now
        logprob = None
        if run.req.sampling.logprobs is not None and logits is not None:
            logprob = run.sampler.logprobs_from(logits, token)
        elif run.req.sampling.logprobs is not None:
            logprob = run.sampler.logprobs(self.ctx, index, token)
        end, stop = run.add_token(self.model, token, logprob)
        self._dirty[run.id] = run
        if end or stop is not None:
            self._finish(run, FinishReason.STOP, stop)
        elif (
            run.req.max_tokens is not None and len(run.generated) >= run.req.max_tokens
        ) or run.n_past + 1 >= self.n_ctx:
            self._finish(run, FinishReason.LENGTH)
        else:
            run.pending = token

    def _finish(self, run: Run, reason: FinishReason, stop: str | None = None) -> None:
        done = run.finish(reason, stop)
        self._dirty[run.id] = run
        self.observer.finished(done)
        if reason is not FinishReason.CANCELLED and stop is None:
            self._queue_turn(run)
        self._release(run)

    def _queue_turn(self, run: Run) -> None:
        """Remember what the next turn of this conversation will most likely start with:
        the answer's last token (sampled, never decoded) unless it ended the turn, then
        the template's end of turn and user header."""
        req, slot = run.req, run.slot
        if not req.next_turn or slot is None or not run.generated or req.lora is not None:
            return
        last = run.generated[-1]
        tokens = ([] if self.model.is_eog(last) else [last]) + list(req.next_turn)
        when = time.monotonic() + self.options.next_turn_delay_s
        self._turns.append(_Turn(slot, len(slot.tokens), _Turn.tail(slot), tokens, when))

    def _continue_turns(self) -> None:
        """Idle: decode the finished sequences' next-turn tokens into them, all in one
        step, so that a follow-up prefills only the user's words and the assistant
        header. One step, not one per sequence: after eight streams end together, eight
        small decodes kept both cores busy for most of a second (a follow-up arriving
        meanwhile waited for the one under way, and so did other programs). Only after
        `next_turn_delay_s` of quiet: a client that asks again at once (an agent, a
        benchmark) would otherwise wait for this decode and then prefill its own words
        in a second one, which costs more than one decode of both. A sequence taken or
        changed since is left alone; newest first while the batch has room. The rows go
        in sequence order: with a KV stream per sequence llama.cpp makes a micro-batch
        of each run of increasing, consecutive sequence ids (see `_one_ubatch`), and
        eight sequences in the order they finished cost up to eight passes over the
        weights (half a second of both cores here, which the next request waited for)."""
        turns = list(self._turns)
        self._turns.clear()
        b = self._batch
        b.clear()
        taken: list[_Turn] = []
        room = b.capacity
        for turn in reversed(turns):
            slot, tokens = turn.slot, turn.tokens
            if slot.busy or not turn.holds(slot) or turn.length + len(tokens) >= self.n_ctx:
                continue  # taken, changed (a reused or moved slot) or full
            if any(slot is t.slot for t in taken) or len(tokens) > room:
                continue
            taken.append(turn)
            room -= len(tokens)
        if not taken:
            self.turns_dropped += len(turns)
            return
        taken.sort(key=lambda t: t.slot.seq)
        for t in taken:
            for j, token in enumerate(t.tokens):
                b.add(token, t.length + j, t.slot.seq, False)
        b.raw.logits[b.n - 1] = True  # llama_decode wants one output
        if self._lora_now != self._lora_default:
            set_lora_scales(self.ctx, self._loras, self._lora_default)
            self._lora_now = self._lora_default
        status = self._decode_idle()
        if status != 0:
            for t in taken:
                ll.llama_memory_seq_rm(self.kv.mem, t.slot.seq, t.length, -1)
            if status == ABORTED:  # a request came: try again when idle next time
                self.turn_aborts += 1
                self._turns.extendleft(reversed(turns))
            return
        self.turn_steps += 1
        self.turns_dropped += len(turns) - len(taken)
        for t in taken:
            t.slot.tokens.extend(t.tokens)
            self.observer.next_turn(len(t.tokens))

    def _decode_idle(self) -> int:
        """`llama_decode` of the batch as idle work: it gives way to work queued before
        or during it (ABORTED at the next node of the graph, a fraction of a
        millisecond, where a request would otherwise wait for the whole decode: up to a
        quarter of a second for eight conversations' turn headers). llama.cpp removes
        the cells of an aborted micro-batch; the caller removes those of the rest.
        The callback takes the GIL at every node, so it is armed for idle decodes only."""
        self._interrupt = False
        if not self._inbox.empty():
            return ABORTED
        ll.llama_set_abort_callback(self.ctx, self._abort_check, None)
        try:
            return int(ll.llama_decode(self.ctx, self._batch.raw))
        finally:
            ll.llama_set_abort_callback(self.ctx, ll.ggml_abort_callback(), None)

    def _release(self, run: Run) -> None:
        """Park the run's sequence for reuse and forget the run."""
        if run.slot is not None:
            self.kv.release(run.slot)
            run.slot = None
        run.sampler.free()
        if run in self._active:
            self._active.remove(run)
        self._runs.pop(run.id, None)

    def _out(self, run: Run, item: Event | BaseException) -> None:
        run.out.append(item)
        self._dirty[run.id] = run

    def _flush(self) -> None:
        """One wake-up per event loop, carrying every sequence's events of this step."""
        runs = list(self._dirty.values())
        self._dirty.clear()
        by_loop: dict[ToLoop, list[tuple[Stream, list[Event | BaseException]]]] = {}
        for run in runs:
            if not run.out:
                continue
            items, run.out = run.out, []
            run.stream.emitted += len(items)
            if run.stream.backlog > run.stream.high_water:
                run.stream.paused = True
            by_loop.setdefault(run.stream.loop, []).append((run.stream, items))
        for to_loop, batch in by_loop.items():
            to_loop.post(streams.deliver, batch)  # a closed loop: its readers are gone

    def _fail_pins(self, error: BarrelError) -> None:
        for job in self._pinning:
            job.slot.busy = False
            job.slot.tokens = []
            ll.llama_memory_seq_rm(self.kv.mem, job.slot.seq, -1, -1)
            job.reply.reject(error)
        self._pinning.clear()
        self._pin_entries = []

    def _fail_all(self, error: BarrelError) -> None:
        self._fail_pins(error)
        runs = list(self._waiting) + list(self._active)
        self._waiting.clear()
        for run in runs:
            self._out(run, error)
            self._release(run)
        self._flush()

    # -- embeddings and teardown ----------------------------------------------------

    def _embed(self, cmd: _Embed) -> None:
        try:
            result = compute_embeddings(
                self.ctx,
                self._batch,
                self._pooled,
                self.options.n_seq_max,
                cmd.inputs,
                cmd.normalize,
            )
        except BarrelError as exc:
            cmd.reply.reject(exc)
            return
        cmd.reply.resolve(result)

    def _free(self) -> None:
        if self.ctx is None:
            return
        for run in list(self._waiting) + self._active:
            run.sampler.free()
        self._batch.free()
        for adapter in self._loras:
            ll.llama_adapter_lora_free(adapter)
        if self.projector is not None:
            self.projector.close()
        if self._drafter is not None:
            self._drafter.free()
            self._drafter = None
        ll.llama_free(self.ctx)
        self.ctx = None
