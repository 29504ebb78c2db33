"""One llama.cpp sampler chain per sequence, built from `SamplingParams`.

Order follows llama.cpp's common sampler: logit bias, penalties, DRY, then either greedy,
mirostat (v1/v2 after temperature), or top-k → typical → top-p → min-p → temperature →
seeded distribution. A grammar is not in the chain: its `Constraint` (llguidance,
barrel.engine.grammar) masks the logits row first, so every stage only sees tokens the
grammar allows; a greedy sequence tries the row's best token first and masks only when
the grammar refuses it. Runs in the engine thread only.
"""

from __future__ import annotations

import ctypes
import functools
import random

import llama_cpp as ll
import numpy as np

from barrel.engine.errors import InvalidGrammar
from barrel.engine.grammar import Constraint
from barrel.engine.model import LlamaModel
from barrel.engine.types import SamplingParams
from barrel.values import TokenLogprob, TopLogprob

# llama.cpp's llama_token_data, for sampling from logits kept outside the context
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LogitRows:
    """Numpy views of a context's logits rows, cached by address.

    A row's view made anew through `np.ctypeslib.as_array` cost 71 us in the daemon,
    right after a decode, against 35 us for a lookup here (bench/NOTEBOOK.md). A
    context's rows sit at the same few addresses step after step. A view is only the
    address and `n_vocab`, and it is looked up only at an address llama.cpp has just
    returned for a row, so a reused entry is always the row itself. Valid until the next
    decode, like the row. Engine thread only.
    """

    LIMIT = 4096  # entries; a context reallocating its outputs leaves stale ones behind

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self._views: dict[int, np.ndarray] = {}

    def __call__(self, ctx: ll.llama_context_p, index: int) -> np.ndarray:
        """The logits of batch position `index`."""
        addr = ctypes.cast(ll.llama_get_logits_ith(ctx, index), ctypes.c_void_p).value
        if not addr:
            raise RuntimeError(f"llama.cpp has no logits for batch position {index}")
        view = self._views.get(addr)
        if view is None:
            if len(self._views) >= self.LIMIT:
                self._views.clear()
            row = (ctypes.c_float * self.n_vocab).from_address(addr)
            view = self._views[addr] = np.ctypeslib.as_array(row)
        return view


@functools.lru_cache(maxsize=4)
def _token_ids(n_vocab: int) -> np.ndarray:
    """0..n_vocab-1 (read-only): the ids of a vocabulary's token data array."""
    ids = np.arange(n_vocab, dtype=np.int32)
    ids.flags.writeable = False
    return ids


class Sampler:
    """Owns one sequence's llama.cpp sampler chain and its grammar constraint: picks the
    next token from a row of logits."""

    def __init__(
        self,
        model: LlamaModel,
        params: SamplingParams,
        n_ctx: int,
        rows: LogitRows | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        self._n_ctx = n_ctx
        self._model = model
        self._rows = rows if rows is not None else LogitRows(model.n_vocab)
        self._chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._keep: list[object] = []  # ctypes buffers the C side points into
        try:
            self._build(model, params)
        except BaseException:
            self.free()
            raise
        # Greedy with nothing before it (no bias, penalties or DRY): the token is
        # the first largest logit, which numpy finds in a tenth of the time the chain
        # takes to copy the vocabulary into its candidate array (25 against 250 us on
        # Qwen's 151,936 tokens), for every sampled token, each draft position included.
        self._argmax = params.greedy and ll.llama_sampler_chain_n(self._chain) == 1

    def _add(self, smpl: ll.llama_sampler_p | None, what: str) -> None:
        if not smpl:
            raise InvalidGrammar(f"llama.cpp refused the {what}")
        ll.llama_sampler_chain_add(self._chain, smpl)

    def _build(self, model: LlamaModel, p: SamplingParams) -> None:
        vocab = model.vocab
        if p.logit_bias:
            arr = (ll.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias.items()):
                arr[i].token = tok  # type: ignore[assignment]
                arr[i].bias = bias
            self._keep.append(arr)
            self._add(ll.llama_sampler_init_logit_bias(model.n_vocab, len(arr), arr), "logit bias")
        if p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            self._add(
                ll.llama_sampler_init_penalties(
                    model.n_vocab,
                    self._window(p.penalty_last_n),
                    p.repeat_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ),
                "penalties",
            )
        if p.dry_multiplier > 0:
            breakers = (ctypes.c_char_p * len(p.dry_sequence_breakers))(
                *[s.encode() for s in p.dry_sequence_breakers]
            )
            self._keep.append(breakers)
            self._add(
                ll.llama_sampler_init_dry(
                    vocab,
                    p.dry_multiplier,
                    p.dry_base,
                    p.dry_allowed_length,
                    self._window(p.dry_penalty_last_n),
                    breakers,
                    len(p.dry_sequence_breakers),
                ),
                "DRY sampler",
            )
        seed = p.seed if p.seed is not None else random.getrandbits(32)
        if p.greedy:
            self._add(ll.llama_sampler_init_greedy(), "greedy sampler")
        elif p.mirostat == 1:
            self._add(ll.llama_sampler_init_temp(p.temperature), "temperature")
            self._add(
                ll.llama_sampler_init_mirostat(
                    model.n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100
                ),
                "mirostat",
            )
        elif p.mirostat == 2:
            self._add(ll.llama_sampler_init_temp(p.temperature), "temperature")
            self._add(
                ll.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta), "mirostat"
            )
        else:
            if p.top_k > 0:
                self._add(ll.llama_sampler_init_top_k(p.top_k), "top-k")
            if p.typical_p < 1.0:
                self._add(ll.llama_sampler_init_typical(p.typical_p, 1), "typical-p")
            if p.top_p < 1.0:
                self._add(ll.llama_sampler_init_top_p(p.top_p, 1), "top-p")
            if p.min_p > 0.0:
                self._add(ll.llama_sampler_init_min_p(p.min_p, 1), "min-p")
            self._add(ll.llama_sampler_init_temp(p.temperature), "temperature")
            self._add(ll.llama_sampler_init_dist(seed & 0xFFFFFFFF), "distribution")

    def _window(self, last_n: int) -> int:
        # The APIs say -1 for "the whole context"; llama.cpp's samplers take a count and
        # treat anything below 1 as "off".
        return self._n_ctx if last_n < 0 else last_n

    def sample(self, ctx: ll.llama_context_p, index: int) -> int:
        """Sample from the logits of batch position `index` and accept the token."""
        if self.constraint is not None:
            return self._constrained(self._rows(ctx, index), self.constraint)
        if self._argmax:
            return int(self._rows(ctx, index).argmax())
        return int(ll.llama_sampler_sample(self._chain, ctx, index))

    def sample_from(self, logits: np.ndarray) -> int:
        """Sample from a row of logits kept from an earlier step and accept the token,
        as `llama_sampler_sample` does with the context's own row."""
        if self.constraint is not None:
            return self._constrained(logits, self.constraint)
        if self._argmax:
            return int(np.argmax(logits))
        return self._chain_sample(logits)

    def _constrained(self, logits: np.ndarray, constraint: Constraint) -> int:
        """Sample among the tokens the grammar allows (the row itself is left as it is:
        logprobs are reported from the raw logits). Greedy: the best token, when the
        grammar allows it, needs no mask."""
        token = int(np.argmax(logits)) if self._argmax else -1
        if token < 0 or not constraint.allows(token):
            masked = constraint.masked(logits)
            token = int(np.argmax(masked)) if self._argmax else self._chain_sample(masked)
        constraint.take(token)
        return token

    def _chain_sample(self, logits: np.ndarray) -> int:
        cur = np.empty(len(logits), dtype=TOKEN_DATA)
        cur["id"] = _token_ids(len(logits))
        cur["logit"] = logits
        cur["p"] = 0.0
        arr = ll.llama_token_data_array(
            cur.ctypes.data_as(ll.llama_token_data_p), len(cur), -1, False
        )
        ll.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError("the sampler chain selected no token")
        token = int(arr.data[arr.selected].id)
        ll.llama_sampler_accept(self._chain, token)
        return token

    def logprobs(self, ctx: ll.llama_context_p, index: int, token: int) -> TokenLogprob:
        """Log-probabilities from the raw logits (before sampling transforms), as the
        OpenAI API reports them."""
        return self.logprobs_from(self._rows(ctx, index), token)

    def logprobs_from(self, logits: np.ndarray, token: int) -> TokenLogprob:
        shifted = logits - logits.max()
        logsum = float(np.log(np.exp(shifted).sum()))
        n = self.params.logprobs or 0
        top: tuple[TopLogprob, ...] = ()
        if n > 0:
            ids = np.argpartition(-shifted, n)[:n]
            ids = ids[np.argsort(-shifted[ids])]
            top = tuple(
                TopLogprob(int(t), self._text(int(t)), float(shifted[t]) - logsum) for t in ids
            )
        return TokenLogprob(token, self._text(token), float(shifted[token]) - logsum, top)

    def _text(self, token: int) -> str:
        return self._model.piece(token).decode("utf-8", errors="replace")

    def free(self) -> None:
        if self._chain:
            ll.llama_sampler_free(self._chain)
            self._chain = None
