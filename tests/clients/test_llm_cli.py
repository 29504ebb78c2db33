"""Simon Willison's `llm` CLI against a live daemon, as its users run it: through the
llm-ollama plugin (OLLAMA_HOST) and through an OpenAI-compatible entry in
extra-openai-models.yaml. What it prints, the models it lists, its --schema output, a
--functions tool it calls, and the token counts it logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import ASK, counted
from tests.daemon import Daemon

LLM = str(Path(sys.executable).parent / "llm")
TOOL = """
def get_weather(city: str) -> str:
    "Get the current weather in a city"
    return "sunny, 21 C in " + city
"""


class Llm:
    """The `llm` command with its own home (a throwaway log database) and the daemon."""

    def __init__(self, daemon: Daemon, home: Path) -> None:
        home.mkdir()
        (home / "extra-openai-models.yaml").write_text(
            f"- model_id: barrel-qwen\n  model_name: qwen\n  api_base: {daemon.url}/v1\n"
            "  supports_schema: true\n  supports_tools: true\n"
        )
        self.env = {**os.environ, "LLM_USER_PATH": str(home), "OLLAMA_HOST": daemon.url}
        self.env.pop("OPENAI_API_KEY", None)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LLM, *args], env=self.env, capture_output=True, text=True, timeout=300, check=False
        )

    def __call__(self, *args: str) -> str:
        done = self.run(*args)
        assert done.returncode == 0, done.stderr
        return done.stdout


@pytest.fixture
def llm(daemon: Daemon, tmp_path: Path) -> Llm:
    return Llm(daemon, tmp_path / "llm")


def _last_log(llm: Llm) -> dict[str, Any]:
    (entry,) = json.loads(llm("logs", "-n", "1", "--json"))
    assert isinstance(entry, dict)
    return entry


def test_llm_ollama_lists_each_model_under_its_own_digest(llm: Llm) -> None:
    listed = llm("models")
    assert "ollama/tiny" in listed
    assert "ollama/qwen" in listed
    table = llm("ollama", "models").splitlines()[1:]
    digests = {line.split()[0]: line.split()[1] for line in table}
    assert set(digests) == {"tiny", "qwen"}
    assert digests["tiny"] != digests["qwen"]  # two models, not one under two names


def test_a_prompt_through_llm_ollama_logs_the_true_usage(daemon: Daemon, llm: Llm) -> None:
    out = llm("-m", "ollama/tiny", "Hi", "-o", "num_predict", "5", "-o", "temperature", "0")
    assert out.strip()
    entry = _last_log(llm)
    assert entry["response"].strip() == out.strip()
    assert entry["input_tokens"] == counted(daemon, "tiny", ASK)
    assert entry["output_tokens"] == 5


@pytest.mark.parametrize("model", ["ollama/qwen", "barrel-qwen"])
def test_schema_output_is_the_json_asked_for(llm: Llm, model: str) -> None:
    args = ["-m", model, "--schema", "name, country", "Paris is in which country?"]
    key = ["--key", "unused"] if model.startswith("barrel") else []
    city = json.loads(llm(*args, *key, "-o", "temperature", "0"))
    assert city["name"] == "Paris"
    assert city["country"] == "France"


@pytest.mark.parametrize("model", ["ollama/qwen", "barrel-qwen"])
def test_a_functions_tool_is_called_with_the_parsed_arguments(llm: Llm, model: str) -> None:
    key = ["--key", "unused"] if model.startswith("barrel") else []
    limit = ["-o", "max_tokens" if key else "num_predict", "60"]
    args = ["-m", model, *key, *limit, "--functions", TOOL, "What is the weather in Paris?"]
    # a chain of two: the call and the answer to its result; the 0.5B model sometimes
    # calls again instead of answering, which llm reports as the chain limit
    done = llm.run(*args, "-o", "temperature", "0", "--td", "--cl", "2")
    assert done.returncode == 0 or "Chain limit of 2 exceeded" in done.stderr, done.stderr
    shown = done.stderr  # --td shows each call and its result there
    assert "Tool call: get_weather({'city': 'Paris'})" in shown
    assert "sunny, 21 C in Paris" in shown
