"""Pooled embeddings of a batch of inputs, several sequences per decode (engine thread)."""

from __future__ import annotations

from typing import Any

import llama_cpp as ll
import numpy as np

from barrel.engine.context import Batch
from barrel.engine.errors import KVCacheFull
from barrel.engine.inbox import Embed
from barrel.errors import BarrelError


def answer_embed(cmd: Embed, ctx: Any, batch: Batch, n_embd: int, n_seq_max: int) -> None:
    """Resolve an `Embed` command with its inputs' pooled embeddings, or reject it."""
    try:
        result = compute_embeddings(ctx, batch, n_embd, n_seq_max, cmd.inputs, cmd.normalize)
    except BarrelError as exc:
        cmd.reply.reject(exc)
        return
    cmd.reply.resolve(result)


def compute_embeddings(
    ctx: Any,
    batch: Batch,
    n_embd: int,
    n_seq_max: int,
    inputs: list[list[int]],
    normalize: bool,
) -> list[list[float]]:
    mem = ll.llama_get_memory(ctx)
    out: list[list[float]] = []
    i = 0
    while i < len(inputs):
        ll.llama_memory_clear(mem, True)
        batch.clear()
        seqs: list[int] = []
        while i < len(inputs) and len(seqs) < n_seq_max:
            toks = inputs[i]
            if batch.n + len(toks) > batch.capacity:
                if not seqs:
                    raise BarrelError(f"an input of {len(toks)} tokens exceeds the batch")
                break
            seq = len(seqs)
            for pos, tok in enumerate(toks):
                batch.add(tok, pos, seq, True)
            seqs.append(seq)
            i += 1
        ret = ll.llama_decode(ctx, batch.raw)
        if ret != 0:
            raise KVCacheFull(f"the embedding batch failed to decode ({ret})")
        for seq in seqs:
            ptr = ll.llama_get_embeddings_seq(ctx, seq)
            if not ptr:
                raise BarrelError("the model produced no pooled embedding")
            vec = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
            if normalize:
                norm = float(np.linalg.norm(vec))
                if norm > 0:
                    vec = vec / norm
            out.append(vec.tolist())
    ll.llama_memory_clear(mem, True)
    return out
