"""A follow-up turn prefills only its own words: once an answer ends, the engine decodes
the chat template's end of turn and next user header into the parked sequence while it
is idle (EngineRequest.next_turn), so the next request finds them in the KV cache."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp as ll
import msgspec
import openai
import pytest

from barrel.engine.engine import Engine, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.types import GREEDY, EngineRequest
from barrel.pipeline.templates import ChatTemplate
from tests.daemon import Daemon, serve_models


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> Iterator[LlamaModel]:
    m = LlamaModel.load(tiny_path)
    yield m
    m.free()


def test_the_template_says_what_follows_an_answer(model: LlamaModel) -> None:
    qwen = ChatTemplate(model.meta("tokenizer.chat_template") or "")
    assert qwen.next_turn == "<|im_end|>\n<|im_start|>user\n"
    llama3 = ChatTemplate(
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content }}<|eot_id|>{% endfor %}"
    )
    assert llama3.next_turn == "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    assert ChatTemplate("{{ messages[-1].content }}").next_turn == ""  # answers not shown


async def _until(check: object, timeout: float = 30.0) -> None:
    """Wait for the engine thread to have done something (a safety-net timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "the engine did not get there"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("max_tokens", [6, None])  # cut by length; ended by the model
async def test_the_follow_up_prefills_only_its_own_words(
    model: LlamaModel, max_tokens: int | None
) -> None:
    e = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=1)).start()
    try:
        head = model.tokenize("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
        turn = model.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False)
        end = model.token_id("<|im_end|>")
        assert end is not None
        # None: the model ends its turn (the end-of-turn token forced at once)
        sampling = GREEDY if max_tokens else msgspec.structs.replace(GREEDY, logit_bias={end: 50.0})
        first = EngineRequest(head, sampling, max_tokens=max_tokens or 8, next_turn=tuple(turn))
        _, done = await e.submit(first).collect()
        answer = [t for t in done.tokens if not model.is_eog(t)]
        slot = e.kv.slots[0]
        await _until(lambda: len(slot.tokens) == len(head) + len(answer) + len(turn))
        assert slot.tokens[len(head) + len(answer) :] == turn
        words = model.tokenize("And now?<|im_end|>\n<|im_start|>assistant\n", add_special=False)
        follow = [*head, *answer, *turn, *words]
        _, again = await e.submit(EngineRequest(follow, GREEDY, max_tokens=2)).collect()
        assert again.usage.prompt_computed == len(words)
        # without next_turn, the same conversation prefills the turn's end as well
        e2 = Engine(model, EngineOptions(n_ctx=1024, n_seq_max=1)).start()
        try:
            plain = EngineRequest(head, sampling, max_tokens=max_tokens or 8)
            _, done2 = await e2.submit(plain).collect()
            assert done2.tokens == done.tokens
            _, again2 = await e2.submit(EngineRequest(follow, GREEDY, max_tokens=2)).collect()
            assert again2.usage.prompt_computed == len(words) + len(turn) + (max_tokens is not None)
            assert again2.tokens == again.tokens  # the same answer either way
        finally:
            await asyncio.to_thread(e2.stop)
    finally:
        await asyncio.to_thread(e.stop)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[Daemon]:
    d = serve_models(tmp_path_factory.mktemp("next-turn"), {"tiny": tiny_path})
    yield d
    d.kill()


def _turn_tokens(daemon: Daemon) -> float:
    text = httpx.get(daemon.url + "/metrics", timeout=30).text
    found = re.search(r'^barrel_engine_next_turn_tokens_total\{model="tiny"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_chat_follow_up_finds_the_turn_header_cached(daemon: Daemon) -> None:
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", timeout=120, max_retries=0)
    messages: list[dict[str, str]] = [{"role": "user", "content": "Count to three."}]
    before = _turn_tokens(daemon)
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=8,  # type: ignore[arg-type]
    )
    # the user reads the answer and types: the engine, idle, prefills the turn's end
    deadline = time.monotonic() + 60
    while _turn_tokens(daemon) == before:
        assert time.monotonic() < deadline, "no next-turn prefill"
        time.sleep(0.02)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Again."},
    ]
    second = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None
    computed = second.usage.prompt_tokens - (details.cached_tokens or 0)
    # only the new words: "Again." and the assistant header, by the daemon's tokenizer
    assert computed == daemon_tokens(daemon, "Again.<|im_end|>\n<|im_start|>assistant\n")


def daemon_tokens(daemon: Daemon, text: str) -> int:
    r = httpx.post(
        daemon.url + "/tokenize",
        json={"model": "tiny", "content": text, "add_special": False},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


async def test_conversations_that_end_together_get_their_turn_headers_in_one_decode(
    model: LlamaModel,
) -> None:
    e = Engine(model, EngineOptions(n_ctx=2048, n_seq_max=4, next_turn_delay_s=0.05)).start()
    try:
        turn = model.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False)
        heads = [
            model.tokenize(f"<|im_start|>user\nQuestion {i}<|im_end|>\n<|im_start|>assistant\n")
            for i in range(4)
        ]
        asks = [EngineRequest(h, GREEDY, max_tokens=6, next_turn=tuple(turn)) for h in heads]
        dones = await asyncio.gather(*(e.submit(a).collect() for a in asks))
        answers = [[t for t in d.tokens if not model.is_eog(t)] for _, d in dones]
        ends = {tuple(h + a + turn) for h, a in zip(heads, answers, strict=True)}
        await _until(lambda: {tuple(s.tokens) for s in e.kv.slots if s.tokens} >= ends)
        assert e.turns.steps == 1  # four sequences, one idle decode
    finally:
        await asyncio.to_thread(e.stop)


async def test_turn_headers_go_in_sequence_order_for_one_micro_batch_a_stream_each(
    model: LlamaModel,
) -> None:
    """With a KV stream per sequence llama.cpp makes a micro-batch of each run of
    increasing, consecutive sequence ids, each a pass over all the weights: the idle
    decode of four conversations' next-turn tokens lists its rows by sequence, not in
    the order the conversations finished (newest first), and every conversation gets
    its tokens."""
    opts = EngineOptions(n_ctx=2048, n_seq_max=4, next_turn_delay_s=0.05, kv_per_sequence=True)
    e = Engine(model, opts).start()
    try:
        turn = model.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False)
        heads = [
            model.tokenize(f"<|im_start|>user\nQuestion {i}<|im_end|>\n<|im_start|>assistant\n")
            for i in range(4)
        ]
        asks = [
            EngineRequest(h, GREEDY, max_tokens=6, ignore_eos=True, next_turn=tuple(turn))
            for h in heads
        ]
        dones = await asyncio.gather(*(e.submit(a).collect() for a in asks))
        ends = {tuple(h + list(d.tokens) + turn) for h, (_, d) in zip(heads, dones, strict=True)}
        await _until(lambda: {tuple(s.tokens) for s in e.kv.slots if s.tokens} >= ends)
        assert e.turns.steps == 1
        rows = e._batch.seqs()  # the idle decode's batch, still in place
        assert len(rows) == 4 * (1 + len(turn))  # each: its last answer token and the header
        assert rows == sorted(rows)
        assert set(rows) == {s.seq for s in e.kv.slots}
    finally:
        await asyncio.to_thread(e.stop)


async def test_a_slot_reused_by_another_conversation_of_the_same_length_is_left_alone(
    model: LlamaModel,
) -> None:
    """A finished conversation's slot taken by another request before its turn header
    was decoded, and left just as long (that request queues no header of its own: a
    completion, not a chat): the first conversation's header does not go into it."""
    opts = EngineOptions(n_ctx=2048, n_seq_max=1, next_turn_delay_s=2.0)
    e = Engine(model, opts).start()
    try:
        turn = model.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False)
        head = model.tokenize("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
        chat = EngineRequest(head, GREEDY, max_tokens=6, ignore_eos=True, next_turn=tuple(turn))
        await e.submit(chat).collect()
        other = [head[1], *head[1:]]  # as long as the chat's prompt, another conversation
        assert len(other) == len(head)
        assert other != head
        _, done = await e.submit(
            EngineRequest(other, GREEDY, max_tokens=6, ignore_eos=True)
        ).collect()
        (slot,) = e.kv.slots
        held = [*other, *done.tokens[:-1]]
        assert slot.tokens == held  # as long as the chat's conversation was
        await _until(lambda: e.turns.steps + e.turns.dropped > 0)  # the header taken up
        assert e.turns.dropped == 1
        assert e.turns.steps == 0
        assert slot.tokens == held
    finally:
        await asyncio.to_thread(e.stop)


class _Held(Engine):
    """An engine whose first idle decode pauses inside llama.cpp, at its abort callback
    after the first node of the graph, until the test has queued a request: a request
    arriving during an idle decode, made certain."""

    def __init__(self, model: LlamaModel, opts: EngineOptions) -> None:
        super().__init__(model, opts)
        self.idle = threading.Event()  # an idle decode is under way
        self.go = threading.Event()

        def held(_data: object) -> bool:
            if not self.idle.is_set():  # (ctypes would swallow an assertion here)
                self.idle.set()
                self.go.wait(30)
            return self.turns.interrupt

        self.turns.abort_check = ll.ggml_abort_callback(held)


async def test_a_request_does_not_wait_for_an_idle_turn_decode(model: LlamaModel) -> None:
    """A request queued while the engine decodes a finished conversation's next-turn
    tokens stops that decode (llama.cpp's abort callback) instead of waiting for it;
    the conversation's cells stay as they were, and its turn tokens are decoded once
    the engine is idle again."""
    opts = EngineOptions(n_ctx=2048, n_seq_max=2, next_turn_delay_s=0.0)
    e = _Held(model, opts).start()
    try:
        turn = model.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False)
        head = model.tokenize("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
        first = EngineRequest(head, GREEDY, max_tokens=6, ignore_eos=True, next_turn=tuple(turn))
        _, done = await e.submit(first).collect()
        answer = list(done.tokens)
        assert await asyncio.to_thread(e.idle.wait, 30)
        other = model.tokenize("<|im_start|>user\nSomething else<|im_end|>\n")
        stream = e.submit(EngineRequest(other, GREEDY, max_tokens=4))
        e.go.set()
        _, interrupting = await stream.collect()
        assert e.turns.aborts == 1
        # the conversation gets its turn tokens after all, in a later idle decode
        slot = next(s for s in e.kv.slots if s.tokens[: len(head)] == head)
        await _until(lambda: slot.tokens == [*head, *answer, *turn])
        assert e.turns.steps == 1
        words = model.tokenize("And now?<|im_end|>\n<|im_start|>assistant\n", add_special=False)
        follow = EngineRequest([*head, *answer, *turn, *words], GREEDY, max_tokens=4)
        _, again = await e.submit(follow).collect()
        assert again.usage.prompt_computed == len(words)
    finally:
        await asyncio.to_thread(e.stop)
    # the same requests on an engine whose idle decode nothing interrupted
    e2 = Engine(model, opts).start()
    try:
        _, done2 = await e2.submit(first).collect()
        await _until(lambda: e2.turns.steps == 1)
        _, interrupting2 = await e2.submit(EngineRequest(other, GREEDY, max_tokens=4)).collect()
        _, again2 = await e2.submit(follow).collect()
        assert (done2.tokens, interrupting2.tokens, again2.tokens) == (
            done.tokens,
            interrupting.tokens,
            again.tokens,
        )
        assert e2.turns.aborts == 0
    finally:
        await asyncio.to_thread(e2.stop)
