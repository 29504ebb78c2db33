"""schemathesis against a live daemon with the tiny model: the examples, coverage,
fuzzing and stateful phases (8 examples an operation, deterministic), every response
checked against openapi.yaml (status, content type, headers, schema: NDJSON lines
through tests/contract/hooks.py, SSE events with their JSON payloads), no 5xx but the
documented 503/529, and no warning that an operation's generated requests were all
refused (tests/contract/schemathesis.toml). The daemon is alive and serving after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.contract.live import HERE, ROOT, SPEC, Live

CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "use_after_free",
    "ensure_resource_availability",
    "ignored_auth",
]


def test_schemathesis_finds_the_daemon_true_to_its_contract(live: Live, tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(HERE / "schemathesis.toml"),
            "run",
            str(SPEC),
            "--url",
            live.url,
            "--checks",
            ",".join(CHECKS),
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--max-examples",
            "8",
            "--generation-deterministic",
            "--request-timeout",
            "120",
            "--no-color",
        ],
        cwd=tmp_path,  # its cache of earlier failures stays out of the run
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.contract.hooks", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, out[-8000:] + run.stderr[-2000:]
    assert "No issues found" in out, out[-4000:]
    assert "WARNINGS" not in out, out[-4000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅  {phase}" in out, out[-4000:]
    # alive and serving (the fuzzer may have deleted any model, as a client may: the
    # model is pulled again first)
    assert live.daemon.proc.poll() is None
    pulled = httpx.post(
        live.url + "/api/pull", json={"model": "tiny-pulled", "stream": False}, timeout=120
    )
    assert pulled.status_code == 200, pulled.text
    r = httpx.post(
        live.url + "/api/chat",
        json={
            "model": "tiny-pulled",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": False,
            "options": {"num_predict": 4},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 4
