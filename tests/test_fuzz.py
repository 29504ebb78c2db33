"""openapi.yaml fuzzed by schemathesis against a live daemon (bounded, deterministic):
no response is a server error, and the daemon is alive and serving at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.daemon import serve_models

ROOT = Path(__file__).resolve().parents[1]
NORMAL = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "options": {"num_predict": 4},
    "stream": False,
}


def test_fuzzing_the_openapi_contract_finds_no_server_error(
    tmp_path: Path, tiny_path: Path
) -> None:
    daemon = serve_models(tmp_path, {"tiny": tiny_path})
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                str(ROOT / "openapi.yaml"),
                "--url",
                daemon.url,
                "--checks",
                "not_a_server_error",
                "--phases",
                "examples,coverage,fuzzing",
                "--max-examples",
                "8",
                "--generation-deterministic",
                "--request-timeout",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert " passed" in run.stdout
        assert daemon.proc.poll() is None, daemon.output()
        r = httpx.post(daemon.url + "/api/chat", json=NORMAL, timeout=5)
        assert r.status_code == 200, r.text
    finally:
        daemon.kill()
