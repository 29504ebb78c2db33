"""The engine: one thread owning one llama_context, with continuous batching.

Thread affinity: `submit`, `cancel`, `embed`, `pin`, `stop`, `inject_fault` and the
tokenizer helpers may be called from any thread; they only put commands in the inbox
(barrel.engine.inbox). Everything else runs in the engine thread, the only code that
touches the context.

Each step is one `llama_decode` holding the next token of every generating sequence plus
chunks of waiting prompts, so a long prompt never freezes the streams already running.
New requests join between steps; cancellation is seen before every step.

This module keeps the loop and its thread rules; the step's work lives in rooms of its
own, each saying what it owns:

- barrel.engine.roster: who is waiting, active, pinning; a run's release.
- barrel.engine.admit: waiting requests take slots (images included).
- barrel.engine.plan: what a step decodes (prompt budget, micro-batch order).
- barrel.engine.verify: draft tokens and which of them a sequence keeps.
- barrel.engine.deliver: sampling, ends, and events to the readers.
- barrel.engine.turns: next-turn tokens decoded while idle.
- barrel.engine.lora: the adapters' scales each step runs under.

KV cells change only through the slot manager (barrel.engine.slots) or by a decode.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as ll

from barrel.engine.admit import Admission, check_media
from barrel.engine.context import (
    Batch,
    EngineOptions,
    effective_options,
    open_context,
)
from barrel.engine.deliver import Delivery
from barrel.engine.embed import answer_embed
from barrel.engine.errors import (
    EngineCrashed,
    EngineStopped,
    KVCacheFull,
    PromptTooLong,
)
from barrel.engine.grammar import Constraint, Grammars
from barrel.engine.inbox import Cancel, Embed, Fault, Pin, PinJob, Stop, Submit, Wake
from barrel.engine.kvcache import StateCache
from barrel.engine.kvdisk import WRITE_WAIT_S, SaveTo, model_states
from barrel.engine.lora import Loras
from barrel.engine.model import LlamaModel
from barrel.engine.observer import EngineObserver, NoObserver
from barrel.engine.plan import Planner, Step
from barrel.engine.roster import Roster, runnable
from barrel.engine.run import Run
from barrel.engine.sampler import LogitRows, Sampler
from barrel.engine.shared import Shared
from barrel.engine.slots import SlotManager
from barrel.engine.states import SavedStates
from barrel.engine.stream import Stream
from barrel.engine.turns import NextTurns
from barrel.engine.types import EngineRequest, FinishReason, RequestId
from barrel.engine.verify import Verifier
from barrel.errors import BarrelError, InvalidRequest
from barrel.futures import Reply, ToLoop

__all__ = ["Engine", "EngineObserver", "EngineOptions"]

logger = logging.getLogger(__name__)

# A place freed while requests queue for one: the next step waits for its new request (a
# few ms on the event loop) up to as long as the last step took, or at least this.
HANDOFF_MIN_S = 0.02


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
        save_to: SaveTo | None = None,
    ) -> None:
        """`save_to`: where states are saved as the engine stops, and restored from."""
        self.model = model
        self.options = opts = effective_options(options or EngineOptions())
        self.name = name
        self.observer: EngineObserver = observer or NoObserver()
        self.on_crash = on_crash
        self.n_ctx = min(opts.n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else opts.n_ctx
        self.ctx: Any
        self.ctx, adapters, self.projector = open_context(model, opts, self.n_ctx)
        self.verifier: Verifier | None = None
        self.loras = Loras(self.ctx, adapters, tuple(lo.scale for lo in opts.loras))
        disk = None
        if save_to is not None and not opts.embedding:
            disk = model_states(save_to, model.path, opts, self.n_ctx)
            disk.disk.load_index()
        states = SavedStates(StateCache(opts.state_cache_bytes), disk, self._resume)
        self.kv = SlotManager(
            self.ctx,
            model,
            opts.n_seq_max,
            opts.max_pins,
            states,
            per_sequence=opts.kv_per_sequence and not opts.embedding,
        )
        self._saving: threading.Event | None = None  # the states being written
        self._batch = Batch(max(opts.n_batch, 1))
        self._rows = LogitRows(model.n_vocab)  # views of the logits rows, shared by samplers
        self.grammars = Grammars(model)  # llguidance over this vocabulary (any thread)
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
        # Open sessions that may submit a request (`expect`); the engine thread only reads
        # it: an idle engine gathers a first step only while one of them has not arrived.
        self._expected = 0
        self._queued = 0  # requests the daemon's queue holds for a place (`set_queued`)
        self.crashed: BaseException | None = None
        self.steps = 0  # decode steps done
        # a reranker's pooled output is its classifier's scores, not a hidden state
        self.ranks = bool(opts.embedding) and (
            ll.llama_pooling_type(self.ctx) == ll.LLAMA_POOLING_TYPE_RANK
        )
        self._pooled = ll.llama_model_n_cls_out(model.handle) if self.ranks else model.n_embd
        # the rooms of a step (see the module's docstring)
        shared = Shared(
            self.ctx, model, opts, self.n_ctx, self._batch, self.kv, self.observer, name
        )
        self.roster = Roster(self.kv)
        self.turns = NextTurns(shared, self.loras, quiet=self._inbox.empty)
        self.delivery = Delivery(shared, self._rows, self.roster, self.turns)
        try:
            self.verifier = Verifier(shared, self.delivery)
        except BaseException:
            self._free()
            raise
        self.admission = Admission(shared, self.roster, self.delivery, self.loras, self.projector)
        self.planner = Planner(shared, self.roster, self.loras, self.verifier, self.admission)

    @property
    def cache(self) -> StateCache:
        return self.kv.states.cache

    # -- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._main, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is in flight, end the thread, free the context."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(Stop())
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine %s did not stop within %ss", self.name, timeout)
                return
        if self._saving is not None and not self._saving.wait(WRITE_WAIT_S):
            logger.warning("engine %s: its states are still being written", self.name)
        self._free()
        # A stopped engine calls no one: its owner's callback (a bound method of the
        # actor that holds the engine) made a reference cycle that kept the engine and
        # all it holds until the garbage collector's next full pass.
        self.on_crash = None

    def join(self, timeout: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    # -- API (any thread) -----------------------------------------------------------

    def submit(self, req: EngineRequest) -> Stream:
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
        req = self.loras.check(req)
        check_media(req, self.projector)
        # Built in the caller's thread (it needs the vocabulary only): a bad grammar fails
        # the request before it is queued; the pipeline compiled it (a worker thread).
        grammar = req.sampling.grammar
        rule = Constraint(self.grammars.matcher(grammar), self.model.n_vocab) if grammar else None
        sampler = Sampler(self.model, req.sampling, self.n_ctx, self._rows, rule)
        rid = RequestId(next(self._ids))
        s = Stream(rid, to_loop, self.cancel, self._resume)
        self._queue_work(Submit(Run(rid, req, s, sampler)), refused=sampler.free)
        return s

    def expect(self, sessions: int) -> None:
        """`sessions` more (negative: fewer) open sessions that may submit a request soon
        (any thread). While more are open than requests have arrived, an idle engine
        holds its first step up to `gather_s` for them; a lone request starts at once."""
        with self._gate:
            self._expected += sessions

    def set_queued(self, requests: int) -> None:
        """`requests` wait in the daemon's queue for a place here (any thread): a run that
        ends while any do holds the next step for the one that takes its place."""
        self._queued = requests

    @property
    def expected(self) -> int:
        """Open sessions that may submit a request (`expect`)."""
        return self._expected

    def cancel(self, request_id: RequestId) -> None:
        self._inbox.put(Cancel(request_id))

    def _resume(self) -> None:
        self._inbox.put(Wake())

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
        self._queue_work(Embed(inputs, normalize, reply))
        return reply.future

    def pin(self, tokens: list[int], scope: str = "") -> asyncio.Future[int]:
        """Keep `tokens` (a static system + tools prefix) prefilled in a pinned sequence;
        requests of `scope` starting with it share its KV cells instead of prefilling them.
        Resolves to the number of tokens pinned (0 if no pin sequence is configured)."""
        if not tokens or len(tokens) >= self.n_ctx:
            raise PromptTooLong(f"a pinned prefix must have 1 to {self.n_ctx - 1} tokens")
        reply: Reply[int] = Reply()
        self._queue_work(Pin(list(tokens), reply, scope))
        return reply.future

    def _queue_work(
        self, cmd: Submit | Embed | Pin, refused: Callable[[], None] | None = None
    ) -> None:
        """Queue work for the engine thread, or raise EngineStopped (after `refused`) if
        it is not running; stop its idle decode, if one is under way
        (`NextTurns.decode`): the flag is set after the command is in the inbox."""
        with self._gate:
            if not self.alive:
                if refused is not None:
                    refused()
                raise EngineStopped(f"engine {self.name} is not running", retry_after=1.0)
            self._inbox.put(cmd)
            self.turns.interrupt = True

    def inject_fault(self, error: BaseException) -> None:
        """Tests only: make the engine thread raise `error` before its next step."""
        self._inbox.put(Fault(error))

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return self.model.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    def count_tokens(self, text: str) -> int:
        return len(self.model.tokenize(text))

    # -- the loop (engine thread) ---------------------------------------------------

    def _main(self) -> None:
        roster = self.roster
        try:
            while not self._stopped.is_set():
                idle = not roster.active and not roster.pinning
                self._drain(block=not self._has_work(), timeout=self.turns.wait())
                if idle and roster.waiting and self.options.gather_s > 0:
                    self._gather(self.options.gather_s, self._coming)
                if self._stopped.is_set():
                    break
                self.admission.admit()
                if roster.active or roster.pinning:
                    running = len(roster.active)
                    took = self._step()
                    if len(roster.active) < running and self._queued and self.kv.free_slots():
                        self._gather(max(took, HANDOFF_MIN_S), lambda: not roster.waiting)
                elif self.turns.due() and not roster.waiting:
                    self.turns.decode()
            self._fail_all(EngineStopped(f"engine {self.name} stopped", retry_after=1.0))
            disk = self.kv.states.disk
            if disk is not None:  # stopped, not crashed: the states go to disk
                self._saving = disk.save(self.kv.states_to_save())
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
            if isinstance(cmd, Submit):
                self.roster.waiting.append(cmd.run)
            elif isinstance(cmd, Embed):
                cmd.reply.reject(error)
        if self.roster.waiting:
            self._fail_all(error)

    def _has_work(self) -> bool:
        roster = self.roster
        admissible = roster.waiting and self.kv.free_slots() and not self.kv.states.reading
        if roster.pinning or admissible or self.turns.due():
            return True
        return any(runnable(r) for r in roster.active)

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

    def _gather(self, seconds: float, coming: Callable[[], bool]) -> None:
        """Requests that arrive within `seconds`, while `coming()` says one is on its way,
        join the next step."""
        deadline = time.monotonic() + seconds
        while coming() and (left := deadline - time.monotonic()) > 0:
            if self._stopped.is_set():
                return
            try:
                self._handle(self._inbox.get(timeout=left))
            except queue.Empty:
                return

    def _coming(self) -> bool:
        """More sessions are open than runs are here: a request is on its way."""
        return self._expected > len(self.roster.waiting) + len(self.roster.active)

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, Submit):
            self.roster.add(cmd.run)
        elif isinstance(cmd, Cancel):
            run = self.roster.runs.get(cmd.id)
            if run is None:
                return
            run.cancelled = True
            if run in self.roster.waiting:
                self.roster.waiting.remove(run)
                self.delivery.finish(run, FinishReason.CANCELLED)
                self.delivery.flush()
        elif isinstance(cmd, Embed):
            answer_embed(cmd, self.ctx, self._batch, self._pooled, self.options.n_seq_max)
        elif isinstance(cmd, Pin):
            slot = self.kv.pin_slot(cmd.tokens, cmd.scope)
            if slot is None:
                pinned = len(cmd.tokens) if self.kv.pins else 0
                cmd.reply.resolve(pinned)
            else:
                self.roster.pinning.append(PinJob(slot, cmd.tokens, cmd.reply))
        elif isinstance(cmd, Fault):
            raise cmd.error
        elif isinstance(cmd, Stop):
            self._stopped.set()

    # -- one step -----------------------------------------------------------------

    def _step(self) -> float:
        """One step; how long its decode took (-1: none)."""
        delivery = self.delivery
        for run in [r for r in self.roster.active if r.cancelled]:
            delivery.finish(run, FinishReason.CANCELLED)
        if self.kv.per_sequence:
            self.planner.close_gap()
        step = self.planner.fill()
        elapsed = -1.0
        if step:
            start = time.monotonic()
            step = self._decode(step)
            elapsed = time.monotonic() - start
            self.steps += 1
            self.planner.timed(elapsed)
            delivery.decoded(step.parts, self.verifier.verify if self.verifier else None)
            self.roster.pinned(step.prefixes)
        cells = self.kv.kv_cells()
        active = len(self.roster.active)
        if elapsed >= 0:
            self.observer.step(self._batch.n, active, cells, elapsed)
        self.observer.occupancy(active, cells, self.kv.busy_cells())
        delivery.flush()
        return elapsed

    def _decode(self, step: Step) -> Step:
        """Decode the batch. With no KV room: evict parked sequences, then idle pinned
        prefixes, then fail the youngest request, rebuilding the batch each time.
        Returns the step decoded (empty: none was)."""
        while True:
            ret = ll.llama_decode(self.ctx, self._batch.raw)
            if ret == 0:
                return step
            if ret != 1:
                raise RuntimeError(f"llama_decode failed with status {ret}")
            if self.kv.evict_lru() or self.kv.evict_pin():
                pass
            elif step.parts:
                youngest = max((r for r, _, _ in step.parts), key=lambda r: r.admitted)
                logger.warning(
                    "engine %s: KV cache full; failing request %s", self.name, youngest.id
                )
                self.delivery.fail(
                    youngest, KVCacheFull("the KV cache is full; retry later", retry_after=1.0)
                )
            else:
                self.roster.fail_pins(
                    KVCacheFull("no KV room for the pinned prefix", retry_after=1.0)
                )
            step = self.planner.fill()
            if not step:
                return step

    def _fail_all(self, error: BarrelError) -> None:
        roster = self.roster
        roster.fail_pins(error)
        runs = list(roster.waiting) + list(roster.active)
        roster.waiting.clear()
        for run in runs:
            self.delivery.fail(run, error)
        self.delivery.flush()

    # -- teardown -------------------------------------------------------------------

    def _free(self) -> None:
        if self.ctx is None:
            return
        roster: Roster | None = getattr(self, "roster", None)
        if roster is not None:
            for run in list(roster.waiting) + roster.active:
                run.sampler.free()
        self._batch.free()
        self.loras.free()
        if self.projector is not None:
            self.projector.close()
        if self.verifier is not None:
            self.verifier.free()
        ll.llama_free(self.ctx)
        self.ctx = None
