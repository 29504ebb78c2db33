"""The completions codec without a model: golden requests and responses."""

from __future__ import annotations

import pytest

from barrel.errors import BarrelError, InvalidRequest
from barrel.http.codecs import Begin
from barrel.http.codecs import openai_completions as codec
from barrel.pipeline.events import Finished, TextDelta
from barrel.pipeline.request import Completion, Dialect, Options
from barrel.values import TokenLogprob, TopLogprob, Usage
from tests.codecs.golden import body, lp, stamp, wire

HEAD = {
    "id": "cmpl-X",
    "object": "text_completion",
    "created": 1_700_000_000,
    "model": "qwen",
    "system_fingerprint": codec.FINGERPRINT,
}


def done(reason: str, prompt: int, completion: int, reused: int = 0, **kw: object) -> Finished:
    usage = Usage(prompt, completion, reused, prompt - reused)
    return Finished(reason, usage, **kw)  # type: ignore[arg-type]


def test_every_prompt_form_decodes_into_one_request_of_runs() -> None:
    req, _ = codec.decode(
        body(
            model="qwen",
            prompt=["The capital of France is", [1, 2, 3]],
            n=2,
            echo=True,
            max_tokens=4,
            temperature=0,
            stop="\n",
            logit_bias={"7": -100},
            logprobs=2,
        )
    )
    assert req.dialect is Dialect.OPENAI
    assert req.messages == ()
    assert req.completion == Completion(
        prompts=("The capital of France is", (1, 2, 3)), echo=True, prompt_logprobs=True
    )
    assert (req.n, req.runs, req.max_tokens, req.logprobs) == (2, 4, 4, 2)
    assert req.options == Options(temperature=0.0, stop=("\n",))
    assert req.logit_bias == {7: -100.0}
    one, _ = codec.decode(body(model="qwen", prompt=[5, 6]))
    assert one.completion is not None
    assert one.completion.prompts == ((5, 6),)
    assert one.max_tokens is None  # the pipeline's default (16) unless the model sets one
    fim, _ = codec.decode(body(model="qwen", prompt="def f(", suffix="\n"))
    assert fim.completion is not None
    assert fim.completion.suffix == "\n"


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"prompt": None}, "prompt must be", "prompt"),
        ({"prompt": []}, "prompt must be", "prompt"),
        ({"prompt": [[True, False]]}, "each prompt", "prompt[0]"),
        ({"prompt": ["a", 3.5]}, "each prompt", "prompt[1]"),
        ({"prompt": [1, 2], "suffix": "x"}, "suffix needs the prompt as text", "suffix"),
        ({"prompt": "x", "logprobs": 21}, "logprobs must be between", "logprobs"),
        (
            {"prompt": "x", "echo": True, "logprobs": 1, "stream": True},
            "without streaming",
            "stream",
        ),
        ({"prompt": "x", "n": 9}, "n must be between", "n"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens"),
        ({"prompt": "x", "temperature": 3}, "temperature", "temperature"),
    ],
)
def test_bad_requests_are_400s_before_any_model(
    fields: dict[str, object], message: str, param: str
) -> None:
    with pytest.raises(InvalidRequest, match=message) as err:
        codec.decode(body(model="qwen", **fields))
    assert err.value.param == param


def test_a_stream_echoes_first_then_text_then_usage_and_done() -> None:
    req, b = codec.decode(
        body(
            model="qwen",
            prompt="1, 2,",
            echo=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    enc = codec.encoder(req, b, stamp())
    assert wire(enc.waiting(2, None)) == [": queued, position 2"]
    frames = enc.begin(Begin(4, echo=("1, 2,",)))
    frames += enc.feed(0, TextDelta(" 3"))
    frames += enc.feed(0, TextDelta(""))  # nothing to say: no frame
    frames += enc.feed(0, done("length", 4, 1, reused=3))
    frames += enc.end()

    def chunk(text: str, reason: str | None = None) -> dict[str, object]:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": reason}
        return {**HEAD, "choices": [choice], "usage": None}

    usage = {
        "prompt_tokens": 4,
        "completion_tokens": 1,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert wire(frames) == [
        chunk("1, 2,"),
        chunk(" 3"),
        chunk("", "length"),
        {**HEAD, "choices": [], "usage": usage},
        "[DONE]",
    ]


def test_streamed_logprobs_carry_their_own_entries_and_offsets() -> None:
    req, b = codec.decode(body(model="qwen", prompt="1, 2,", logprobs=1, stream=True))
    enc = codec.encoder(req, b, stamp())
    enc.begin(Begin(4, echo=("",)))
    first = wire(enc.feed(0, TextDelta(" 3", (lp(" 3", -0.1),))))
    second = wire(enc.feed(0, TextDelta(",", (lp(",", -0.2),))))
    assert first[0]["choices"][0]["logprobs"] == {
        "tokens": [" 3"],
        "token_logprobs": [-0.1],
        "top_logprobs": [{}],
        "text_offset": [0],
    }
    assert second[0]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert "usage" not in second[0]


def test_several_prompts_times_n_are_choices_and_the_prompt_counts_once_per_prompt() -> None:
    req, b = codec.decode(body(model="qwen", prompt=["a", "bb"], n=2, max_tokens=1))
    enc = codec.encoder(req, b, stamp())
    enc.begin(Begin(1, echo=("", "", "", "")))
    for i, (text, prompt, reused) in enumerate(
        [("x", 1, 0), ("y", 1, 1), ("z", 2, 0), ("w", 2, 2)]
    ):
        enc.feed(i, TextDelta(text))
        enc.feed(i, done("cancelled" if i == 3 else "length", prompt, 1, reused))
    enc.end()
    full = enc.full()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in full["choices"]] == [
        (0, "x", "length"),
        (1, "y", "length"),
        (2, "z", "length"),
        (3, "w", "stop"),
    ]
    assert full["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert full["object"] == "text_completion"


def test_a_scored_prompt_puts_its_logprobs_in_front_the_first_null() -> None:
    req, b = codec.decode(body(model="qwen", prompt="Paris", echo=True, logprobs=1, max_tokens=1))
    enc = codec.encoder(req, b, stamp())
    enc.begin(Begin(2, echo=("Par" + "is",)))
    enc.feed(0, TextDelta("!", (lp("!", -2.0),)))
    scored = (
        TokenLogprob(10, "Par", None),
        TokenLogprob(11, "is", -0.5, (TopLogprob(11, "is", -0.5),)),
    )
    enc.feed(0, done("length", 2, 1, prompt_logprobs=scored))
    (choice,) = enc.full()["choices"]
    assert choice["text"] == "Paris!"
    assert choice["logprobs"] == {
        "tokens": ["Par", "is", "!"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"is": -0.5}, {}],
        "text_offset": [0, 3, 5],
    }


def test_a_generation_that_ends_without_a_result_and_a_failed_stream() -> None:
    req, b = codec.decode(body(model="qwen", prompt="x", stream=True))
    enc = codec.encoder(req, b, stamp())
    with pytest.raises(BarrelError, match="without a result"):
        enc.end()
    (frame,) = wire(enc.error(BarrelError("engine stopped")))
    assert frame["error"]["message"] == "engine stopped"
    assert "choices" not in frame
