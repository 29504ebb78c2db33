"""The aiohttp app in-process: middlewares, health, readiness, metrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from barrel import __version__
from barrel.actors.supervisor import ChildSpec, SupervisorEnv, SupFlags, supervisor_spec
from barrel.config import Config
from tests.apps import app_for, services_of
from tests.probes import Probe, worker

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


def cfg(**sections: dict[str, Any]) -> Config:
    return msgspec.convert(sections, Config)


def probe_tree(
    probe: Probe, *names: str, intensity: int = 10
) -> Callable[[SupervisorEnv], ChildSpec]:
    def build(env: SupervisorEnv) -> ChildSpec:
        children = [ChildSpec(n, worker(probe)) for n in names]
        return supervisor_spec("root", SupFlags(intensity=intensity, period=10), children, env)

    return build


async def booted(client: Client) -> None:
    runtime = services_of(client.server.app).runtime
    await asyncio.to_thread(runtime.booted.wait, 10)


@pytest.fixture
async def client(aiohttp_client: MakeClient) -> Client:
    c = await aiohttp_client(app_for(Config()))
    await booted(c)
    return c


async def test_health_and_version(client: Client) -> None:
    resp = await client.get("/health")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok"}
    resp = await client.get("/api/version")
    assert await resp.json() == {"version": __version__}


async def test_request_id_is_echoed_or_minted(client: Client) -> None:
    resp = await client.get("/health", headers={"X-Request-ID": "abc-123"})
    assert resp.headers["X-Request-ID"] == "abc-123"
    minted = (await client.get("/health")).headers["X-Request-ID"]
    assert minted.startswith("req_")
    assert len(minted) > 8
    assert (await client.get("/health")).headers["X-Request-ID"] != minted
    hostile = (await client.get("/health", headers={"X-Request-ID": "a b;c"})).headers
    assert hostile["X-Request-ID"].startswith("req_")
    # error responses carry it too
    resp = await client.get("/nope", headers={"X-Request-ID": "err-1"})
    assert resp.status == 404
    assert resp.headers["X-Request-ID"] == "err-1"


async def test_access_log_writes_one_line_per_request(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="barrel.access")
    await client.get("/health", headers={"X-Request-ID": "log-me"})
    lines = [r.getMessage() for r in caplog.records if r.name == "barrel.access"]
    assert len(lines) == 1
    assert '"GET /health HTTP/1.1" 200' in lines[0]
    assert lines[0].endswith("log-me")


@pytest.mark.parametrize(
    ("path", "check"),
    [
        ("/v1/chat/completions", lambda b: b["error"]["code"] == "request_too_large"),
        (
            "/v1/messages",
            lambda b: b["type"] == "error" and b["error"]["type"] == "request_too_large",
        ),
        ("/api/chat", lambda b: "exceeds the limit" in b["error"]),
    ],
)
async def test_oversize_body_is_413_in_the_dialect_of_the_path(
    client: Client, path: str, check: Callable[[Any], bool]
) -> None:
    resp = await client.post(path, data=b"x" * (2 * 1024 * 1024))
    assert resp.status == 413
    assert check(await resp.json())


async def test_chunked_oversize_body_hits_the_same_cap(aiohttp_client: MakeClient) -> None:
    app = app_for(cfg(limits={"max_request_body_bytes": 1000}))
    seen: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen.append(len(body))
        return web.json_response({"n": len(body)})

    app.router.add_post("/api/echo", echo)
    client = await aiohttp_client(app)

    async def chunks() -> Any:
        for _ in range(10):
            yield b"y" * 500

    resp = await client.post("/api/echo", data=chunks())
    assert resp.status == 413
    assert "error" in await resp.json()
    assert seen == []
    resp = await client.post("/api/echo", data=b"z" * 999)
    assert await resp.json() == {"n": 999}


async def test_dns_rebinding_defence_on_loopback(client: Client) -> None:
    for host in ("evil.example", "attacker.com:8080", "192.168.1.5"):
        resp = await client.get("/health", headers={"Host": host})
        assert resp.status == 403, host
        assert "not allowed" in (await resp.json())["error"]["message"]
    for host in ("localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080", "foo.localhost"):
        resp = await client.get("/health", headers={"Host": host})
        assert resp.status == 200, host


async def test_any_host_is_accepted_when_bound_to_all_interfaces(
    aiohttp_client: MakeClient,
) -> None:
    client = await aiohttp_client(app_for(cfg(server={"host": "0.0.0.0"})))
    assert (await client.get("/health", headers={"Host": "box.lan:8080"})).status == 200


async def test_cors_is_off_by_default(client: Client) -> None:
    headers = {"Origin": "http://app.test", "Access-Control-Request-Method": "POST"}
    resp = await client.options("/api/chat", headers=headers)
    assert "Access-Control-Allow-Origin" not in resp.headers
    resp = await client.get("/health", headers={"Origin": "http://app.test"})
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_cors_preflight_and_response_headers(aiohttp_client: MakeClient) -> None:
    app = app_for(cfg(cors={"allow_origins": ["http://app.test"], "max_age_s": 99}))
    client = await aiohttp_client(app)
    resp = await client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://app.test",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization",
        },
    )
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "http://app.test"
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    assert resp.headers["Access-Control-Max-Age"] == "99"

    resp = await client.get("/health", headers={"Origin": "http://app.test"})
    assert resp.headers["Access-Control-Allow-Origin"] == "http://app.test"
    assert "X-Request-ID" in resp.headers["Access-Control-Expose-Headers"]
    # error responses are readable cross-origin too
    resp = await client.get("/nope", headers={"Origin": "http://app.test"})
    assert resp.headers["Access-Control-Allow-Origin"] == "http://app.test"

    bad = {"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"}
    resp = await client.options("/v1/chat/completions", headers=bad)
    assert resp.status == 403
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_api_keys(aiohttp_client: MakeClient) -> None:
    client = await aiohttp_client(app_for(cfg(auth={"api_keys": ["sekret"]})))
    assert (await client.get("/health")).status == 200
    assert (await client.get("/health/ready")).status in (200, 503)
    resp = await client.get("/api/version")
    assert resp.status == 401
    assert "missing API key" in (await resp.json())["error"]
    resp = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    body = await resp.json()
    assert resp.status == 401
    assert body["error"]["type"] == "authentication_error"
    assert (
        await client.get("/api/version", headers={"Authorization": "Bearer sekret"})
    ).status == 200
    assert (await client.get("/api/version", headers={"x-api-key": "sekret"})).status == 200


async def test_unexpected_handler_error_is_a_json_500(aiohttp_client: MakeClient) -> None:
    app = app_for(Config())

    async def broken(_request: web.Request) -> web.Response:
        raise ZeroDivisionError

    app.router.add_get("/v1/broken", broken)
    client = await aiohttp_client(app)
    resp = await client.get("/v1/broken")
    assert resp.status == 500
    assert (await resp.json())["error"] == {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    resp = await client.post("/health")
    assert resp.status == 405
    assert "GET" in resp.headers["Allow"]


async def test_ready_is_503_until_the_tree_is_up(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    gate = threading.Event()
    probe.block_init["slow"] = gate
    app = app_for(Config(), tree=probe_tree(probe, "fast", "slow"))
    client = await aiohttp_client(app)
    try:
        resp = await client.get("/health/ready")
        assert resp.status == 503
        assert (await resp.json())["status"] == "starting"
        assert (await client.get("/health")).status == 200, "liveness does not wait for the tree"
    finally:
        gate.set()
    await booted(client)
    resp = await client.get("/health/ready")
    assert resp.status == 200
    assert await resp.json() == {"status": "ready", "actors": 3}


async def test_ready_names_children_that_are_down(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    # A restart that keeps failing is retried (by message) without end here: b stays down
    # while root keeps answering between attempts.
    app = app_for(Config(), tree=probe_tree(probe, "a", "b", intensity=10**9))
    client = await aiohttp_client(app)
    await booted(client)
    runtime = services_of(app).runtime
    probe.fail_init["b"] = 10**9
    try:
        runtime.registry.get("b").tell("crash")
        await asyncio.to_thread(probe.wait_for, lambda evs: ("init_failed", "b") in evs)
        for _ in range(500):  # the supervisor records the failure just after init raises
            if any("refuses" in e.reason for e in runtime.registry.entries() if e.name == "b"):
                break
            await asyncio.sleep(0.01)
        resp = await client.get("/health/ready")
        body = await resp.json()
        assert resp.status == 503
        assert body["status"] == "degraded"
        assert [d["name"] for d in body["down"]] == ["b"]
        assert body["down"][0]["state"] == "restarting"
        assert "refuses to start" in body["down"][0]["reason"]
    finally:
        probe.fail_init["b"] = 0  # let it come back before teardown
        await asyncio.to_thread(runtime.registry.wait_for, "b", timeout=5)


async def test_slow_actor_does_not_block_health(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    app = app_for(Config(), tree=probe_tree(probe, "busy"))
    client = await aiohttp_client(app)
    await booted(client)
    gate = threading.Event()
    busy = services_of(app).runtime.registry.get("busy")
    busy.proxy().block(gate)  # the actor is now stuck in a long call
    try:
        ready = asyncio.create_task(client.get("/health/ready"))
        for _ in range(5):
            # waiting on the busy actor would never end before the gate opens below
            resp = await asyncio.wait_for(client.get("/health"), 60)
            assert resp.status == 200
        assert not ready.done(), "readiness is still waiting for the busy actor's ping"
        resp = await ready
        body = await resp.json()
        assert resp.status == 503
        assert body["down"] == [
            {
                "name": "busy",
                "state": "unresponsive",
                "reason": "Worker.ping did not answer within 1.0s",
            }
        ]
    finally:
        gate.set()


async def test_metrics(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    app = app_for(Config(), tree=probe_tree(probe, "w"))
    client = await aiohttp_client(app)
    await booted(client)
    registry = services_of(app).runtime.registry
    old = registry.get("w")
    old.tell("crash")
    await asyncio.to_thread(registry.wait_for, "w", other_than=old, timeout=5)
    await client.get("/health")
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.content_type == "text/plain"
    text = await resp.text()
    assert 'barrel_supervisor_restarts_total{child="w"} 1.0' in text
    assert 'barrel_http_requests_total{method="GET",route="/health",status="200"} 1.0' in text
    assert "barrel_http_request_duration_seconds_bucket" in text
    assert f'barrel_build_info{{version="{__version__}"}} 1.0' in text
    assert "process_resident_memory_bytes" in text


async def test_tree_is_stopped_with_the_app(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    app = app_for(Config(), tree=probe_tree(probe, "a", "b"))
    client = await aiohttp_client(app)
    await booted(client)
    await client.close()
    assert probe.of("stop") == [("stop", "b", "normal"), ("stop", "a", "normal")]


async def test_failed_boot_is_fatal(aiohttp_client: MakeClient) -> None:
    probe = Probe()
    probe.fail_init["a"] = 1
    fatal = asyncio.Event()
    reasons: list[str] = []

    def on_fatal(why: str) -> None:
        reasons.append(why)
        fatal.set()

    app = app_for(Config(), tree=probe_tree(probe, "a"), on_fatal=on_fatal)
    client = await aiohttp_client(app)
    await asyncio.wait_for(fatal.wait(), 5)
    assert "failed to start" in reasons[0]
    assert "refuses to start" in reasons[0]
    assert (await client.get("/health/ready")).status == 503
