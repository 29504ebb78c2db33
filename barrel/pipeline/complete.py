"""A prompt completed as it was given (`Completion`: OpenAI's completions, Ollama's raw
prompt and suffix) on the generation path.

No chat template and no parsing: each prompt (text, token ids, or a fill-in-the-middle
prefix and suffix) becomes tokens, each is run `n` times (run index = prompt * n +
choice), and the text comes back as it was generated. `echo` puts each prompt in front
of its answer; with `prompt_logprobs` (echo with logprobs: scoring a text, as evaluation
harnesses do with max_tokens 0) the prompt is computed again and each of its tokens gets
its logprob, the first one none.

Tokenizing runs in the caller's worker thread (`tokens`, `echoes`); `run` reads the
engine's stream on the loop.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from barrel.engine.engine import Engine
from barrel.engine.types import Done, EngineRequest
from barrel.pipeline.events import ChatEvent, Finished, TextDelta
from barrel.pipeline.request import Completion
from barrel.values import TokenLogprob, Usage


class Vocabulary(Protocol):
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def piece(self, token: int, *, special: bool = False) -> str: ...

    def check_tokens(self, tokens: list[int], param: str) -> None: ...

    def fim_prompt(self, prefix: str, suffix: str) -> list[int]: ...


def tokens(vocab: Vocabulary, completion: Completion) -> list[list[int]]:
    """Each prompt's tokens (token ids checked against the vocabulary)."""
    out = []
    for i, p in enumerate(completion.prompts):
        if not isinstance(p, str):
            vocab.check_tokens(list(p), f"prompt[{i}]" if len(completion.prompts) > 1 else "prompt")
            out.append(list(p))
        elif completion.suffix:
            out.append(vocab.fim_prompt(p, completion.suffix))
        else:
            out.append(vocab.tokenize(p, add_special=True))
    return out


def echoes(vocab: Vocabulary, completion: Completion, prompts: list[list[int]]) -> list[str]:
    """Each prompt as the head of its answers: as sent, or, when its tokens are scored,
    their pieces (so that the offsets of their logprobs point into it)."""
    if not completion.echo:
        return [""] * len(prompts)
    out = []
    for given, prompt in zip(completion.prompts, prompts, strict=True):
        if completion.prompt_logprobs:
            out.append("".join(vocab.piece(t) for t in prompt))
        else:
            out.append(given if isinstance(given, str) else vocab.detokenize(prompt))
    return out


async def run(
    engine: Engine,
    req: EngineRequest,
    first_piece: Callable[[int], str],
) -> AsyncGenerator[ChatEvent, None]:
    """Generate `req` unparsed: its text as it comes, then Finished. A run that
    generates nothing and scores nothing ends at once, without a prefill."""
    if req.max_tokens == 0 and not req.prompt_logprobs:
        yield Finished("length", Usage(len(req.prompt), 0, 0, len(req.prompt)))
        return
    done: Done | None = None
    async with engine.submit(req) as stream:
        async for event in stream:
            if isinstance(event, Done):
                done = event
                break
            yield TextDelta(event.text, event.logprobs)
    assert done is not None
    scored: tuple[TokenLogprob, ...] = ()
    if req.prompt_logprobs:
        head = TokenLogprob(req.prompt[0], first_piece(req.prompt[0]), None)
        scored = (head, *done.prompt_logprobs)
    yield Finished(
        done.finish_reason.value,
        done.usage,
        done.timings.prefill_s,
        done.timings.decode_s,
        done.stop_sequence,
        context=(*req.prompt, *done.answer),
        prompt_logprobs=scored,
    )
