"""Models registered with --model (the demo model of `make serve`) are first-class: a
digest and details in /api/tags and /api/ps, NAME:latest in every dialect, and copy,
show and delete through the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai

from tests.daemon import serve_models
from tests.test_cli import barrel


def test_cp_show_rm_and_latest_work_on_a_model_given_with_dash_dash_model(
    tmp_path: Path, tiny_path: Path
) -> None:
    daemon = serve_models(tmp_path, {"demo": tiny_path})
    try:
        tags = httpx.get(daemon.url + "/api/tags", timeout=30).json()["models"]
        (demo,) = tags
        assert re.fullmatch(r"[0-9a-f]{64}", demo["digest"])
        assert demo["details"]["family"] == "qwen2"
        # NAME:latest, in each dialect
        chat = {"model": "demo:latest", "messages": [{"role": "user", "content": "Hi"}]}
        r = httpx.post(
            daemon.url + "/api/chat",
            json={**chat, "stream": False, "options": {"num_predict": 3}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        sdk = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        assert sdk.chat.completions.create(**chat, max_tokens=3).choices  # type: ignore[call-overload]
        assert sdk.models.retrieve("demo:latest").id == "demo:latest"
        ps = httpx.get(daemon.url + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in ps] == ["demo"]  # one engine for both names
        assert ps[0]["details"]["family"] == "qwen2"
        assert ps[0]["digest"] == demo["digest"]
        # copy, show, delete through the CLI
        assert barrel(daemon, "cp", "demo", "mine").returncode == 0
        shown = barrel(daemon, "show", "mine")
        assert shown.returncode == 0, shown.stderr
        assert "qwen2" in shown.stdout
        listed = barrel(daemon, "ls").stdout
        assert "mine" in listed
        assert "demo" in listed
        assert barrel(daemon, "rm", "mine").returncode == 0
        found = httpx.post(daemon.url + "/api/search", json={"query": "dem"}, timeout=30).json()
        assert [m["source"] for m in found["models"] if m["name"].startswith("demo")] == ["local"]
        # a file given on the command line is not the daemon's to remove: 409, saying where
        refused = httpx.request("DELETE", daemon.url + "/api/delete", json={"model": "demo"})
        assert refused.status_code == 409
        assert "command line (--model)" in refused.json()["error"]
        assert barrel(daemon, "rm", "demo").returncode != 0
        names = [
            m["name"] for m in httpx.get(daemon.url + "/api/tags", timeout=30).json()["models"]
        ]
        assert names == ["demo:latest"] or names == ["demo"]
        assert tiny_path.exists()
    finally:
        daemon.kill()
