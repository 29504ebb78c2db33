"""The in-memory store behind the Responses API's previous_response_id."""

from __future__ import annotations

from barrel.http.response_store import ResponseStore
from barrel.pipeline.request import text


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _put(store: ResponseStore, rid: str) -> None:
    store.put({"id": rid}, (text("user", rid),))


def test_entries_expire_after_their_ttl() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=10.0, max_stored=100, clock=clock)
    _put(store, "a")
    clock.now += 6
    _put(store, "b")
    got = store.get("a")
    assert got is not None
    assert got.messages == (text("user", "a"),)
    clock.now += 5  # a is 11 s old, b 5 s
    assert store.get("a") is None
    assert store.get("b") is not None
    assert len(store) == 1


def test_the_oldest_go_first_beyond_the_count_and_delete() -> None:
    store = ResponseStore(ttl_s=60.0, max_stored=2, clock=Clock())
    for rid in ("a", "b", "c"):
        _put(store, rid)
    assert store.get("a") is None
    assert store.get("b") is not None
    assert store.delete("b")
    assert not store.delete("b")
    assert len(store) == 1


def test_max_stored_zero_keeps_nothing() -> None:
    store = ResponseStore(ttl_s=60.0, max_stored=0, clock=Clock())
    _put(store, "a")
    assert store.get("a") is None
