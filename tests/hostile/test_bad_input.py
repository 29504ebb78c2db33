"""Input that used to be a 500 is a 400 (or 401) in the dialect's envelope."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon, serve_models
from tests.hostile.conftest import NORMAL, Hostile, assert_4xx


def test_json_nested_a_thousand_deep_is_a_400(hostile: Hostile) -> None:
    deep = '{"a":' * 1000 + "1" + "}" * 1000
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": ' + deep + "}"
    for path in ("/v1/chat/completions", "/api/chat", "/v1/messages", "/api/create"):
        r = hostile.post(path, content=body, headers={"Content-Type": "application/json"})
        assert_4xx(r, 400, "nests deeper")
    hostile.still_serving()


def test_logit_bias_keys_that_are_not_ascii_digits_are_a_400(hostile: Hostile) -> None:
    for key in ("²", "٣", "1.5", "-1"):
        r = hostile.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "logit_bias": {key: 1},
            },
        )
        assert_4xx(r, 400, "logit_bias")
    hostile.still_serving()


def test_an_invalid_schema_with_thinking_on_is_a_400_before_any_thinking(hostile: Hostile) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    r = hostile.post("/api/chat", json={**NORMAL, "think": True, "format": bad})
    assert_4xx(r, 400, "schema")
    hostile.still_serving()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Iterator[Daemon]:
    d = serve_models(
        tmp_path_factory.mktemp("keyed"), {"tiny": tiny_path}, '[auth]\napi_keys = ["sekret"]\n'
    )
    yield d
    d.kill()


def test_a_key_that_is_not_utf8_is_a_401(keyed: Daemon) -> None:
    for raw in (b"\xff\xfe", "s\u00e9kret".encode("latin-1"), b"sekret\x80"):
        r = httpx.post(
            keyed.url + "/api/chat", json=NORMAL, headers=[(b"x-api-key", raw)], timeout=10
        )
        assert_4xx(r, 401)
    ok = httpx.post(
        keyed.url + "/api/chat", json=NORMAL, headers={"x-api-key": "sekret"}, timeout=10
    )
    assert ok.status_code == 200
