"""The structured-output corpus (tests/schema_corpus.py, 200+ schemas as clients send
them) through Barrel on Qwen2.5-Coder-0.5B Q4_K_M, greedy, four at a time.

    .venv/bin/python -m bench.corpus [--record]

Every schema is asked as a client asks (`response_format` json_schema, or a forced tool
whose parameters it is) and its answer checked (tests.schema_corpus.check): a document of
the schema, or, cut at max_tokens, the start of one, or a 400 naming the feature
llguidance lacks. Prints the counts, the seconds and every failure; exits 1 on a failure.
`--record` writes what each schema was answered with to tests/data/corpus_answers.json:
tests/test_structured_corpus.py checks, without a model, that the grammar of each schema
accepts that answer token by token through the real vocabulary and refuses it broken
(the suite runs ~15 of the schemas through Qwen itself, tests/test_structured.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from barrel.store import bundled
from bench.http import MODEL, start_daemon, wait_ready
from tests.schema_corpus import ANSWERS, answer_text, check, corpus, request

AT_ONCE = 4


async def ask_all(url: str) -> list[tuple[int, dict[str, Any]]]:
    gate = asyncio.Semaphore(AT_ONCE)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await wait_ready(session, url, "/health/ready", timeout=120)

        async def one(schema: dict[str, Any], how: str) -> tuple[int, dict[str, Any]]:
            async with gate:
                body = request(schema, how, MODEL)
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    return r.status, await r.json()

        return await asyncio.gather(*(one(s, how) for _, s, how in corpus()))


def record(answers: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for (name, _, how), (status, body) in zip(corpus(), answers, strict=True):
        entry: dict[str, Any] = {"name": name, "how": how, "status": status}
        if status == 200:
            entry["finish"] = body["choices"][0]["finish_reason"]
            entry["text"] = (
                answer_text(body, how)
                if entry["finish"] != "length"
                else (body["choices"][0]["message"]["content"] or "")
            )
        else:
            entry["error"] = body.get("error", {}).get("message", "")
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", action="store_true", help=f"write {ANSWERS}")
    args = parser.parse_args()
    model = bundled.assemble("qwen2.5-coder-0.5b")
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_daemon(Path(tmp), model, AT_ONCE)
        try:
            start = time.monotonic()
            answers = asyncio.run(ask_all(url))
            seconds = time.monotonic() - start
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    entries = list(corpus())
    failures = [
        f
        for (name, schema, how), (status, body) in zip(entries, answers, strict=True)
        if (f := check(name, schema, how, status, body))
    ]
    refused = sum(status == 400 for status, _ in answers)
    cut = sum(
        status == 200 and body["choices"][0]["finish_reason"] == "length"
        for status, body in answers
    )
    print(f"{len(entries)} schemas in {seconds:.0f} s: {refused} refused, {cut} cut at max_tokens")
    for failure in failures:
        print("FAILED", failure)
    if args.record:
        ANSWERS.parent.mkdir(parents=True, exist_ok=True)
        ANSWERS.write_text(json.dumps(record(answers), indent=1, ensure_ascii=False) + "\n")
        print(f"recorded {ANSWERS}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
