"""schemathesis against a live daemon with the tiny model: the examples, coverage,
fuzzing and stateful phases (8 examples an operation, deterministic), every response
checked against openapi.yaml (status, content type, headers, schema: NDJSON lines
through tests/contract/hooks.py, SSE events with their JSON payloads), no 5xx but the
documented 503/529, and no warning that an operation's generated requests were all
refused (tests/contract/schemathesis.toml). The daemon is alive and serving after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

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


def stored_responses(live: Live, n: int) -> list[str]:
    """Ids of responses the daemon stores, for the operations that read and delete one."""
    ids = []
    for i in range(n):
        r = httpx.post(
            live.url + "/v1/responses",
            json={"model": "tiny", "input": f"Hi {i}", "max_output_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    return ids


def config_with(tmp: Path, ids: list[str]) -> Path:
    """tests/contract/schemathesis.toml, with this run's stored response ids as the
    values of the {id} of GET and DELETE /v1/responses/{id} (a random id is a 404, and
    an operation answering nothing but 404 is a warning of missing test data)."""
    path = tmp / "schemathesis.toml"
    half = len(ids) // 2  # read ones and deleted ones apart: a read finds its response
    path.write_text(
        (HERE / "schemathesis.toml").read_text()
        + f"\n[dictionaries.read]\nvalues = {json.dumps(ids[:half])}\n"
        + f"\n[dictionaries.deleted]\nvalues = {json.dumps(ids[half:])}\n"
        + '\n[[operations]]\ninclude-operation-id = "getResponse"\n'
        + 'parameters = { "path.id" = { dictionary = "read" } }\n'
        + '\n[[operations]]\ninclude-operation-id = "deleteResponse"\n'
        + 'parameters = { "path.id" = { dictionary = "deleted" } }\n'
    )
    return path


# the run is about 4 minutes on 2 busy cores (its coverage phase sends 5,000 requests,
# some generating to the end of the context): more than the suite's 300 s per test
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_schemathesis_finds_the_daemon_true_to_its_contract(live: Live, tmp_path: Path) -> None:
    config = config_with(tmp_path, stored_responses(live, 16))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
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
    # no failure; warnings that the schema and the validation disagree fail the run (the
    # config's fail-on), the rest are shown: there are none today, but a fuzzer's choice
    # of ids that all miss is not a broken contract
    assert "Failures:" not in out, out[-4000:]
    assert "Schema validation mismatch" not in out, out[-4000:]
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
