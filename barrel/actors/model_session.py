"""A model as a request sees it: valid only while its lease is held.

`Models.open(...)` yields a `ModelSession`. Everything a handler does with the model
goes through it: the vocabulary, sampling, the chat template, the engine (which the
generation path, barrel.pipeline.generation, runs), embeddings and reranking. The session
holds the model (`LlamaModel.retain`), so an unload in the middle stops the engine but
frees the vocabulary only after the last session let go; once the session is closed,
every method raises `SessionClosed` instead of touching the model.

Thread affinity: methods run on the event loop; `tokenize`, `detokenize` and `piece`
are also safe from a worker thread while the session is open (vocabulary only).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from barrel.actors.loader import ModelSpec
from barrel.engine.engine import Engine
from barrel.engine.types import SamplingParams
from barrel.errors import BarrelError, InvalidRequest
from barrel.pipeline.request import Dialect
from barrel.pipeline.sampling import GGUF_SAMPLING, effective, recommended, sampling_params
from barrel.pipeline.templates import ChatTemplate, make_template


class SessionClosed(BarrelError):
    """A handler used its model after the lease ended: a bug, never freed memory."""

    status = 500
    code = "session_closed"


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@dataclass
class ModelCaches:
    """What sessions of one model share, by (model, manifest digest): the compiled chat
    template and the GGUF's recommended sampling. Loop thread only."""

    templates: dict[tuple[str, str], ChatTemplate] = field(default_factory=dict)
    sampling: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    render_budget_s: float | None = None  # each render of a chat template


class ModelSession:
    def __init__(
        self,
        spec: ModelSpec,
        engine: Engine,
        caches: ModelCaches,
        timings: Callable[[float, float], None] | None = None,
        *,
        runs: int = 0,
    ) -> None:
        self.spec = spec
        self._engine = engine
        self._model = engine.model
        self._caches = caches
        self._timings = timings
        self._open = True
        # the engine sequences this session will run: an idle engine holds its first
        # step for them (Engine.expect)
        self._expected = runs
        if runs:
            engine.expect(runs)

    # -- the lease ------------------------------------------------------------------

    def _live(self) -> Engine:
        if not self._open:
            raise SessionClosed(f"the session on {self.spec.name} was used after its release")
        return self._engine

    def close(self) -> None:
        self._open = False
        if self._expected:
            self._engine.expect(-self._expected)
            self._expected = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def n_ctx(self) -> int:
        return self._live().n_ctx

    @property
    def adapters(self) -> int:
        """LoRA adapters loaded with the model (ids 0..adapters-1 of the `lora` field)."""
        return len(self.spec.engine.loras)

    @property
    def n_vocab(self) -> int:
        self._live()
        return self._model.n_vocab

    # -- vocabulary -------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        self._live()
        return self._model.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: list[int]) -> str:
        self._live()
        return self._model.detokenize(tokens)

    def piece(self, token: int, *, special: bool = False) -> str:
        """One token's text (a partial UTF-8 sequence shows as U+FFFD); `special`
        renders control tokens too."""
        self._live()
        return self._model.piece(token, special=special).decode("utf-8", errors="replace")

    def check_tokens(self, tokens: list[int], param: str) -> None:
        vocab = self.n_vocab
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidRequest(f"{param}: token ids must be in [0, {vocab})", param=param)

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle: prefix and suffix around the model's FIM tokens, the answer
        being the middle. A model without those tokens cannot do it (400)."""
        self._live()
        model = self._model
        pre, suf, mid = (model.token_id(t) for t in FIM_TOKENS)
        if pre is None or suf is None or mid is None:
            raise InvalidRequest(
                "this model does not support insert (fill-in-the-middle)", param="suffix"
            )
        return [
            pre,
            *model.tokenize(prefix, add_special=False),
            suf,
            *model.tokenize(suffix, add_special=False),
            mid,
        ]

    # -- sampling ---------------------------------------------------------------------

    def sampling(
        self, dialect: Dialect, options: dict[str, Any]
    ) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
        """The request's options over the model's stored PARAMETERs over what the GGUF
        recommends (not for Ollama) over the dialect's defaults (barrel.pipeline.sampling)."""
        self._live()
        merged = effective(dialect, options, self.spec.parameters, self.recommended_sampling())
        sampling, limit, stop = sampling_params(merged)
        # A penalty window spans at most the context (llama.cpp allocates it whole).
        n_ctx = self.n_ctx
        windows = {}
        for name in ("penalty_last_n", "dry_penalty_last_n"):
            value = getattr(sampling, name)
            if value < -1 or value > n_ctx:
                windows[name] = n_ctx
        if windows:
            sampling = msgspec.structs.replace(sampling, **windows)
        return sampling, limit, stop

    def recommended_sampling(self) -> dict[str, Any]:
        self._live()
        key = (self.spec.name, self.spec.digest)
        cached = self._caches.sampling.get(key)
        if cached is None:
            model = self._model
            meta = {k: v for k in GGUF_SAMPLING if (v := model.meta(k)) is not None}
            cached = self._caches.sampling[key] = recommended(meta)
        return cached

    # -- chat -------------------------------------------------------------------------

    @property
    def stored_messages(self) -> tuple[dict[str, Any], ...]:
        """The model's MESSAGEs (Modelfile, /api/create), as chat templates read them."""
        return self.spec.messages

    @property
    def stored_system(self) -> str | None:
        """The model's SYSTEM (Modelfile, /api/create)."""
        return self.spec.system

    async def template(self) -> ChatTemplate:
        """The model's compiled chat template (cached by model and manifest digest)."""
        self._live()
        key = (self.spec.name, self.spec.digest)
        cached = self._caches.templates.get(key)
        if cached is None:
            model = self._model
            source = self.spec.template or model.meta("tokenizer.chat_template") or ""
            bos = self._special(model.bos)
            eos = self._special(model.eos)
            budget = self._caches.render_budget_s
            cached = await asyncio.to_thread(make_template, source, bos, eos, budget)
            self._caches.templates[key] = cached
        return cached

    def _special(self, token: int) -> str:
        if token < 0:
            return ""
        return self._model.piece(token, special=True).decode(errors="replace")

    # -- the engine and embeddings ----------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The model's engine, for the generation path (barrel.pipeline.generation)."""
        return self._live()

    @property
    def timings(self) -> Callable[[float, float], None] | None:
        """Metrics' callback for a chat run's (render seconds, parse seconds)."""
        return self._timings

    async def embed(
        self, inputs: list[list[int]], *, normalize: bool = True, truncate: bool = False
    ) -> list[list[float]]:
        engine = self._live()
        if engine.ranks:
            raise InvalidRequest(f"model {self.name!r} is a reranker: it has no embeddings")
        return await engine.embed(inputs, normalize=normalize, truncate=truncate)

    async def rerank(self, query: str, documents: list[str]) -> tuple[list[float], int]:
        """Each document's relevance to `query` (the model's classifier score, for a
        model opened with `embedding=True`), and the tokens read."""
        engine = self._live()
        if not engine.ranks:
            raise InvalidRequest(f"model {self.name!r} is not a reranker", param="model")
        model = self._model
        inputs = await asyncio.to_thread(lambda: [model.rerank_tokens(query, d) for d in documents])
        scores = await engine.embed(inputs, normalize=False)
        return [float(s[0]) for s in scores], sum(len(i) for i in inputs)
