"""A pull reaches only public https addresses (and the registries the configuration
names): never the daemon's own network, after DNS and after every redirect, and its
errors do not tell an open port from a closed one."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from barrel.errors import InvalidRequest
from barrel.store.netpolicy import NetPolicy, PrivateAddress
from tests.daemon import free_port, serve_models
from tests.hostile.conftest import Hostile, assert_4xx


class _Redirector(http.server.BaseHTTPRequestHandler):
    target = ""
    hits = 0

    def do_GET(self) -> None:
        type(self).hits += 1
        self.send_response(302)
        self.send_header("Location", self.target)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def redirector() -> Iterator[str]:
    """A server that redirects every GET to a loopback admin path."""
    _Redirector.target = f"https://127.0.0.1:{free_port()}/admin/delete-everything"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Redirector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _pull(h: Hostile, model: str, **more: object) -> object:
    return h.post("/api/pull", json={"model": model, "stream": False, **more}, timeout=30)


def test_private_loopback_and_link_local_addresses_are_refused(hostile: Hostile) -> None:
    for url in (
        "https://127.0.0.1:1/x.gguf",
        "https://localhost/x.gguf",
        "https://169.254.169.254/latest/meta-data/x.gguf",
        "https://10.1.2.3/x.gguf",
        "https://192.168.0.1/x.gguf",
    ):
        assert_4xx(_pull(hostile, url), 403, "private network")  # type: ignore[arg-type]
    # a registry host the configuration does not name is no way around it
    assert_4xx(_pull(hostile, "127.0.0.1:9/library/x"), 403, "private network")  # type: ignore[arg-type]
    hostile.still_serving()


def test_plain_http_needs_insecure_and_the_error_says_so(hostile: Hostile) -> None:
    r = _pull(hostile, "http://203.0.113.9/x.gguf")
    assert_4xx(r, 400, "insecure")  # type: ignore[arg-type]
    r = _pull(hostile, "http://127.0.0.1:1/x.gguf", insecure=True)
    assert_4xx(r, 403, "private network")  # type: ignore[arg-type]


def test_a_redirect_to_a_private_address_is_refused(
    tmp_path: Path, tiny_path: Path, redirector: str
) -> None:
    """The first hop is a registry the configuration names (trusted); it redirects the
    manifest to a loopback admin path, which the pull refuses to follow."""
    d = serve_models(
        tmp_path, {"tiny": tiny_path}, f'[registry.hosts]\n"mirror.test" = "{redirector}"\n'
    )
    try:
        h = Hostile(d, tmp_path)
        assert_4xx(_pull(h, "mirror.test/library/x"), 403, "private network")  # type: ignore[arg-type]
        assert _Redirector.hits >= 1  # the trusted hop was made; the redirect was not
        h.still_serving()
    finally:
        d.kill()


def test_errors_do_not_tell_open_ports_from_closed_ones(hostile: Hostile) -> None:
    port = int(hostile.url.rsplit(":", 1)[1])
    open_one = _pull(hostile, f"https://127.0.0.1:{port}/x.gguf")
    closed = _pull(hostile, "https://127.0.0.1:1/x.gguf")
    assert open_one.status_code == closed.status_code == 403  # type: ignore[attr-defined]
    assert open_one.json()["error"].replace(str(port), "1") == closed.json()["error"]  # type: ignore[attr-defined]


def test_the_policy_sees_through_ipv6_forms() -> None:
    policy = NetPolicy()
    for url in ("https://[::1]/x", "https://[::ffff:127.0.0.1]/x", "https://[fe80::1]/x"):
        with pytest.raises(PrivateAddress):
            policy.check(url)
    trusted = NetPolicy.trusting(["http://127.0.0.1:9"])
    trusted.check("http://127.0.0.1:9/v2/x")  # configured: trusted as written
    with pytest.raises(InvalidRequest, match="insecure"):
        trusted.check("http://127.0.0.1:10/v2/x")
