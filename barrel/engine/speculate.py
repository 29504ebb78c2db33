"""Prompt-lookup speculative decoding: drafts with no draft model.

A sequence's next tokens often repeat a stretch of its own context (a code edit copies
most of the file, a RAG answer quotes its sources, tool arguments repeat the prompt).
`NgramDrafter` finds the last earlier occurrence of the sequence's trailing n-gram and
proposes the tokens that followed it. Once a whole draft is kept and the token sampled
after it is the source's next one too, the next draft goes on from there: a copy is
followed in order, where the latest occurrence of the n-gram may be an earlier part of
the copy itself (a file of similar functions: `def shape_` was last followed by the
previous function's number). The engine decodes the pending token and the
draft in one step (each with logits), then samples position by position: a draft token
is kept only while it equals the token sampled there, so the output (and the seeded
sampler's random stream) is exactly what one-token steps would give; the first
mismatch's sampled token becomes the next pending token and the rejected cells are
removed from the KV. Engine thread only.
"""

from __future__ import annotations

# Verifying a draft costs a wider decode step, and on CPUs the step from one token to
# two is the dear one (Qwen 0.5B on 2 cores: 20 ms for one token, 44 for two, 62 for
# four, 116 for sixteen). So a draft starts at FIRST_DRAFT and doubles while whole
# drafts are kept (up to k), shrinks to what was kept after a miss (never under
# MIN_DRAFT), and a run stops drafting when its attempts keep less than MIN_KEPT tokens
# on average, once it has made MIN_ATTEMPTS. Lengths are 4n - 1: with the pending token
# the step is a multiple of ALIGN (see align_drafts).
FIRST_DRAFT = 15
MIN_DRAFT = 3
MIN_KEPT = 1.0
MIN_ATTEMPTS = 8


class NgramDrafter:
    """The history of one sequence (prompt and generated tokens) and an index of its
    n-grams: `ngram -> the position of the token that followed its latest occurrence`."""

    def __init__(self, tokens: list[int], n: int, k: int) -> None:
        self.n = max(1, n)
        self.k = k
        self.history: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        self.drafted = 0
        self.accepted = 0
        self.attempts = 0
        self._length = min(FIRST_DRAFT, k)
        self._drafted_from: int | None = None  # where the last draft started in history
        self._follow: int | None = None  # where the copy goes on after a kept draft
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        n, h, index = self.n, self.history, self._index
        for token in tokens:
            h.append(token)
            if len(h) > n:
                # the n-gram before the newest token, pointing at it; the trailing n-gram
                # itself stays out until a token follows it
                index[tuple(h[-n - 1 : -1])] = len(h) - 1
        return None

    def draft(self, room: int) -> list[int]:
        """Up to min(the current draft length, room) tokens: where the copy the last
        kept draft came from goes on, else what followed the trailing n-gram last time."""
        h, follow = self.history, self._follow
        self._drafted_from = self._follow = None
        limit = min(self._length, room)
        if limit <= 0 or len(h) < self.n or not self.active:
            return []
        if follow is not None and follow < len(h) - 1 and h[follow] == h[-1]:
            start: int | None = follow + 1  # the copy goes on
        else:
            start = self._index.get(tuple(h[-self.n :]))
        if start is None:
            return []
        self._drafted_from = start
        return h[start : start + limit]

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.attempts += 1
        if accepted == drafted:
            self._length = min(self.k, self._length * 2 + 1)
            if self._drafted_from is not None:
                # the token sampled after the draft is expected here in the source
                self._follow = self._drafted_from + drafted
        else:
            self._length = max(MIN_DRAFT, min(self.k, accepted + 2))

    @property
    def active(self) -> bool:
        """False once drafting has not paid for this sequence."""
        return self.attempts < MIN_ATTEMPTS or self.accepted >= MIN_KEPT * self.attempts


# ggml's CPU matrix products take the rows of a batch four at a time (llamafile's
# tinyBLAS tiles for q8_0 / q5_0 weights, the repacked Q4_K / Q4_0 kernels) and the one
# to three left over nearly at the cost of a one-row product. That is dearest in the
# output projection (vocabulary x embedding, the largest matrix of a small model),
# which runs on every row with logits, and every draft row has logits. Measured on
# Qwen 0.5B, 2 cores, a 600-cell context, every token with logits: 4 tokens 62 ms, 5
# tokens 82-86, 8 86, 16 116, 17 134-143, 48 306-315, 49 322-345 (a prefill, logits on
# its last row only, shows almost none of it: bench/NOTEBOOK.md). A step's drafts
# are trimmed to make it a multiple of ALIGN.
ALIGN = 4


def align_drafts(drafts: list[list[int]], n: int) -> None:
    """Trim the drafts of a step of `n` tokens (drafts included) in place, so that the
    step is a multiple of ALIGN: the last tokens of the longest drafts go (they are the
    least likely to be kept). With fewer draft tokens than that takes, all go: a step
    of one to three tokens costs more than what its drafts are likely to keep."""
    extra = n % ALIGN
    total = sum(len(d) for d in drafts)
    if not extra or not total:
        return
    if total < extra:
        for d in drafts:
            d.clear()
        return
    for _ in range(extra):
        max(drafts, key=len).pop()
