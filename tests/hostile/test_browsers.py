"""A web page in the user's browser cannot create, pull, unload or delete models."""

from __future__ import annotations

from tests.hostile.conftest import NORMAL, Hostile, assert_4xx

EVIL = {"Origin": "https://evil.example", "Content-Type": "text/plain"}


def test_a_simple_request_from_a_foreign_page_is_refused(hostile: Hostile) -> None:
    """text/plain needs no CORS preflight: before, it was parsed as JSON and served."""
    for path, body in [
        ("/api/create", '{"model": "evil", "from": "tiny.gguf", "stream": false}'),
        ("/api/pull", '{"model": "evil/model", "stream": false}'),
        ("/api/generate", '{"model": "tiny", "keep_alive": 0}'),
        ("/api/chat", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}]}'),
    ]:
        assert_4xx(hostile.post(path, content=body, headers=EVIL), 403, "not allowed")
    r = httpx_delete(hostile, {"model": "tiny"}, EVIL)
    assert_4xx(r, 403)
    assert hostile.post("/api/show", json={"model": "evil"}).status_code == 404
    hostile.still_serving()


def test_a_local_page_must_send_json_as_json(hostile: Hostile) -> None:
    local = {"Origin": "http://localhost:3000"}
    r = hostile.post("/api/chat", json=NORMAL, headers=local)
    assert r.status_code == 200, r.text
    form = {**local, "Content-Type": "application/x-www-form-urlencoded"}
    assert_4xx(hostile.post("/api/chat", content=b"{}", headers=form), 415, "application/json")
    # clients that send no Origin (SDKs, curl -d) keep working whatever the content type
    r = hostile.post("/api/chat", json=NORMAL, headers={"Content-Type": "text/plain"})
    assert r.status_code == 200


def httpx_delete(h: Hostile, body: dict[str, str], headers: dict[str, str]) -> object:
    import json

    import httpx

    return httpx.request(
        "DELETE", h.url + "/api/delete", content=json.dumps(body), headers=headers, timeout=10
    )
