"""`python -m barrel.engine.trial [--embedding] [--mmproj PROJECTOR] PATH`: load a model
the way the engine does, tokenize, and decode one batch (and with a projector, load it
and encode an image or a one-second clip, whichever it reads); exit 0 when all of it worked.

llama.cpp aborts the whole process on some malformed models (a GGML_ASSERT on a
duplicate vocabulary entry, a tensor of the wrong shape). New files are tried here, in a
child process, before they enter the store (`barrel.store.trial`): an abort kills only
the child.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import llama_cpp as ll

from barrel.engine.context import Batch, EngineOptions, new_context
from barrel.engine.model import LlamaModel
from barrel.engine.projector import Projector, solid_png, tone_wav

N_CTX = 64


def trial(path: str, embedding: bool, mmproj: str | None = None) -> None:
    model = LlamaModel.load(path)
    opts = EngineOptions(
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_ubatch=N_CTX,
        n_seq_max=1,
        max_pins=0,
        threads=1,
        embedding=embedding,
    )
    ctx = new_context(model, opts, N_CTX)
    tokens = model.tokenize("Hello, world! 1 + 1 = 2", add_special=True)[: N_CTX // 2]
    model.detokenize(tokens)
    batch = Batch(N_CTX)
    for pos, token in enumerate(tokens):
        batch.add(token, pos, 0, logits=pos == len(tokens) - 1)
    if tokens and ll.llama_decode(ctx, batch.raw) != 0:
        raise SystemExit("llama_decode failed on the first batch")
    batch.free()
    if mmproj is not None:
        projector = Projector(Path(mmproj), model, threads=1, use_gpu=False)
        sample = solid_png((200, 30, 30)) if projector.reads_images else tone_wav(1.0)
        [piece] = projector.read({hashlib.sha256(sample).hexdigest(): sample}).values()
        for media in piece.media:
            projector.encode(media)
        del piece, media
        projector.close()
    ll.llama_free(ctx)
    model.free()


if __name__ == "__main__":
    args = sys.argv[1:]
    projector = args[args.index("--mmproj") + 1] if "--mmproj" in args else None
    trial(args[-1], "--embedding" in args, projector)
