"""Constrained decoding on llguidance: a model's tokenizer for it, grammars compiled and
checked before a request takes a sequence, and each constrained sequence's `Constraint`,
which masks the logits row its token is sampled from.

Who owns what: `Grammars` belongs to an engine and is used from any thread (the
pipeline compiles in a worker thread, so a bad grammar is a 400 before anything is
queued; `Engine.submit` takes a copy of the compiled matcher). A `Constraint` belongs
to one sequence's sampler and lives in the engine thread.

Every step of a matcher is bounded by llguidance's fuel (`limits`): a grammar that
would need more fails its own sequence (`InvalidGrammar`), never slows the others.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import llama_cpp as ll
import llguidance as llg
import numpy as np

from barrel.engine.errors import InvalidGrammar
from barrel.engine.model import LlamaModel

# llguidance's resource limits, its defaults written out: lexer fuel runs ~14k units a
# millisecond and Earley items ~20k, so one mask costs at most ~15 ms whatever the
# grammar; building the lexer's regexes at most ~20 ms. Errors name the rule, never
# the client's text (verbose_errors off).
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
INITIAL_LEXER_FUEL = 1_000_000
COMPILED = 64  # compiled grammars kept per model (LRU): a client sends the same schema


def limits() -> llg.LLParserLimits:
    return llg.LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,
    )


class Grammars:
    """llguidance over one model's vocabulary. The tokenizer is built once, by the
    first caller that needs it (~0.8 s for a 152k vocabulary, in that caller's thread,
    never the engine's); compiled matchers are kept by grammar text and copied out."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._tokenizer: llg.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)

    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _tokenizer(self._model)
            return self._tokenizer

    def matcher(self, grammar: str) -> llg.LLMatcher:
        """A fresh matcher for `grammar` (llguidance's JSON or Lark text), at its start.
        Raises InvalidGrammar with llguidance's reason for a grammar it refuses."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        tokenizer = self.tokenizer()
        compiled = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
        if compiled.is_error():
            raise InvalidGrammar(_reason(compiled.get_error()))
        with self._lock:
            self.compiles += 1
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()


def _tokenizer(model: LlamaModel) -> llg.LLTokenizer:
    """llguidance's tokenizer over llama.cpp's vocabulary: each token's bytes, control
    tokens (and user-defined ones written like them, `<...>`) marked with a leading 0xFF
    as llguidance expects, every end-of-generation token as an end, and llama.cpp's own
    tokenizer for the text llguidance forces."""
    vocab = model.vocab
    control = ll.LLAMA_TOKEN_ATTR_CONTROL
    user = ll.LLAMA_TOKEN_ATTR_USER_DEFINED
    buf = ctypes.create_string_buffer(4096)
    tokens: list[bytes] = []
    ends: list[int] = []
    for token in range(model.n_vocab):
        n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
        piece = buf.raw[: max(n, 0)]
        attr = ll.llama_vocab_get_attr(vocab, token)
        if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
            piece = b"\xff" + piece
        tokens.append(piece)
        if ll.llama_vocab_is_eog(vocab, token):
            ends.append(token)
    tokenize = ctypes.cast(ll.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    made: llg.LLTokenizer = llg.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens,
        vocab_ptr=vocab,
        tokenize_fptr=tokenize,
        eos_token=ends or ll.llama_vocab_eos(vocab),
        slices=None,
    )
    return made


def _reason(error: str) -> str:
    error = error.replace("<non-verbose/>", "").strip()
    return f"the schema or grammar cannot be used: {error or 'refused by llguidance'}"


class Constraint:
    """One sequence's matcher: which tokens may come next, and the tokens taken.
    Engine thread only."""

    def __init__(self, matcher: llg.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def allows(self, token: int) -> bool:
        return bool(self._matcher.validate_tokens([token]) == 1)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n_vocab)
        if not allowed.any():
            raise InvalidGrammar("the grammar allows no token here")
        return np.where(allowed.view(bool), logits, np.float32(-np.inf))

    def take(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()

    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation (fast-forward)."""
        tokens = self._matcher.compute_ff_tokens()
        self._check()
        return tokens

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (its end of text only)."""
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise InvalidGrammar(_reason(self._matcher.get_error()))
