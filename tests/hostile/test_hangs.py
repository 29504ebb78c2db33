"""Work a request can make endless or enormous is bounded: refused before it starts, or
stopped by its time budget, and the event loop never waits on it."""

from __future__ import annotations

import threading
import time

import httpx

from tests.hostile.conftest import NORMAL, Hostile, assert_4xx


def test_a_pathological_schema_pattern_is_served_and_a_huge_schema_refused(
    hostile: Hostile,
) -> None:
    # (a?){200}a{200} multiplied llama.cpp's grammar stacks (minutes a token); llguidance
    # serves it, or refuses it when its lexer would grow past its limits (which, depends
    # on the grammar around it); tests/test_structured.py has the costly kinds.
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a?){200}a{200}$"}},
        "required": ["s"],
    }
    body = {**NORMAL, "format": schema, "options": {"num_predict": 8, "temperature": 0}}
    r = hostile.post("/api/chat", json=body)
    if r.status_code == 200:
        assert r.json()["message"]["content"].startswith('{"s": "'), r.text
    else:
        assert_4xx(r, 400, "grammar")
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    assert_4xx(hostile.post("/api/chat", json={**NORMAL, "format": huge}), 400, "bytes")
    hostile.still_serving()


def test_a_template_that_loops_for_ever_is_stopped_off_the_event_loop(hostile: Hostile) -> None:
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    made = hostile.post(
        "/api/create",
        json={"model": "loops", "from": "tiny.gguf", "template": loop, "stream": False},
    )
    assert made.status_code == 200, made.text
    answer: dict[str, httpx.Response] = {}

    def chat() -> None:
        answer["r"] = hostile.post("/api/chat", json={**NORMAL, "model": "loops"})

    worker = threading.Thread(target=chat)
    worker.start()
    health = []
    while worker.is_alive():
        t = time.monotonic()
        assert httpx.get(hostile.url + "/health", timeout=5).status_code == 200
        health.append(time.monotonic() - t)
    worker.join()
    assert_4xx(answer["r"], 400, "template")
    assert max(health) < 1.0, health  # the loop kept answering while the template ran
    hostile.still_serving()


def test_many_prompts_times_many_choices_is_a_400(hostile: Hostile) -> None:
    r = hostile.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * 500, "n": 8})
    assert_4xx(r, 400, "sequences")
    r = hostile.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 9},
    )
    assert_4xx(r, 400)
    hostile.still_serving()


def test_eighty_thousand_stop_strings_are_a_400(hostile: Hostile) -> None:
    stops = [f"s{i}" for i in range(80_000)]
    r = hostile.post("/api/chat", json={**NORMAL, "options": {"stop": stops}})
    assert_4xx(r, 400, "stop")
    r = hostile.post("/api/chat", json={**NORMAL, "options": {"stop": ["x" * 5000]}})
    assert_4xx(r, 400, "stop")
    # one limit for every dialect: limits.max_stop (16)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": stops[:17]}
    assert_4xx(hostile.post("/v1/chat/completions", json=ask), 400, "16 stop")
    ask = {"model": "tiny", "prompt": "x", "stop": stops[:17]}
    assert_4xx(hostile.post("/v1/completions", json=ask), 400, "16 stop")
    ok = {"model": "tiny", "prompt": "x", "stop": stops[:16], "max_tokens": 2}
    assert hostile.post("/v1/completions", json=ok).status_code == 200
    hostile.still_serving()


def test_a_penalty_window_beyond_the_context_is_served_within_it(hostile: Hostile) -> None:
    for window in (2**31 - 1, 2**28, -7):
        body = {
            **NORMAL,
            "options": {"num_predict": 4, "repeat_last_n": window, "repeat_penalty": 1.2},
        }
        r = hostile.post("/api/chat", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True
    hostile.still_serving()
