"""`barrel run MODEL [PROMPT]`: one answer, or an interactive chat with streamed output.

Interactive commands: /bye, /set parameter NAME VALUE, /set system TEXT, /clear, /?.
Text between triple quotes spans several lines. Piped stdin is the prompt (after PROMPT,
when both are given) and gets one answer. `--verbose` prints timings and rates after
each answer, on stderr, as Ollama's does.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, TextIO

from barrel.client import BarrelClient

HELP = """Commands:
  /set parameter NAME VALUE   set a sampling option (temperature, num_predict, ...)
  /set system TEXT            set the system message
  /clear                      forget the conversation
  /bye                        leave
Use \"\"\" to begin and end a message that spans several lines."""


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def stats(final: dict[str, Any]) -> str:
    """Ollama's --verbose block, from the last object of a chat stream."""

    def seconds(key: str) -> float:
        return float(final.get(key, 0)) / 1e9

    def rate(count: str, duration: str) -> str:
        d = seconds(duration)
        return f"{final.get(count, 0) / d:.2f} tokens/s" if d > 0 else "-"

    rows = [
        ("total duration", f"{seconds('total_duration'):.3f}s"),
        ("load duration", f"{seconds('load_duration'):.3f}s"),
        ("prompt eval count", f"{final.get('prompt_eval_count', 0)} token(s)"),
        ("prompt eval duration", f"{seconds('prompt_eval_duration'):.3f}s"),
        ("prompt eval rate", rate("prompt_eval_count", "prompt_eval_duration")),
        ("eval count", f"{final.get('eval_count', 0)} token(s)"),
        ("eval duration", f"{seconds('eval_duration'):.3f}s"),
        ("eval rate", rate("eval_count", "eval_duration")),
    ]
    return "\n".join(f"{name + ':':<22}{value}" for name, value in rows)


async def answer(
    client: BarrelClient,
    model: str,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    out: TextIO,
    verbose: bool = False,
) -> str:
    parts = []
    final: dict[str, Any] = {}
    async for event in client.chat(model, messages, options=options or None):
        piece = (event.get("message") or {}).get("content", "")
        if piece:
            out.write(piece)
            out.flush()
            parts.append(piece)
        if event.get("done"):
            final = event
    out.write("\n")
    out.flush()
    if verbose:
        print(stats(final), file=sys.stderr, flush=True)
    return "".join(parts)


async def _read(prompt: str) -> str:
    return await asyncio.to_thread(input, prompt)


async def _message() -> str | None:
    """One user message (None at end of input); triple quotes span lines."""
    try:
        line = await _read(">>> ")
    except EOFError:
        return None
    if not line.lstrip().startswith('"""'):
        return line
    text = line.lstrip()[3:]
    lines = [text]
    while not lines[-1].rstrip().endswith('"""'):
        try:
            lines.append(await _read("... "))
        except EOFError:
            break
    joined = "\n".join(lines).rstrip()
    return joined[:-3] if joined.endswith('"""') else joined


async def interactive(client: BarrelClient, model: str, out: TextIO, verbose: bool = False) -> int:
    await client.load(model)  # fail early (unknown model) and load before the first prompt
    messages: list[dict[str, Any]] = []
    options: dict[str, Any] = {}
    system: str | None = None
    while True:
        text = await _message()
        if text is None:
            return 0
        stripped = text.strip()
        if stripped in ("/bye", "/exit"):
            return 0
        if stripped.startswith("/set parameter "):
            parts = stripped.split(maxsplit=3)
            if len(parts) != 4:
                out.write("Usage: /set parameter NAME VALUE\n")
                continue
            options[parts[2]] = _value(parts[3])
            out.write(f"Set parameter '{parts[2]}' to '{parts[3]}'\n")
        elif stripped.startswith("/set system "):
            system = stripped.removeprefix("/set system ").strip()
            out.write("Set system message.\n")
        elif stripped == "/clear":
            messages = []
            out.write("Cleared the conversation.\n")
        elif stripped in ("/?", "/help"):
            out.write(HELP + "\n")
        elif stripped.startswith("/"):
            out.write(f"Unknown command '{stripped.split()[0]}'. Type /? for help.\n")
        elif stripped:
            messages.append({"role": "user", "content": text})
            head = [{"role": "system", "content": system}] if system else []
            reply = await answer(client, model, [*head, *messages], options, out, verbose)
            messages.append({"role": "assistant", "content": reply})
        out.flush()


async def run_model(
    client: BarrelClient, model: str, prompt: str | None, verbose: bool = False
) -> int:
    out = sys.stdout
    if not sys.stdin.isatty():
        piped = await asyncio.to_thread(sys.stdin.read)
        if piped.strip():
            prompt = f"{prompt}\n{piped}" if prompt else piped
    if prompt is None:
        return await interactive(client, model, out, verbose)
    await answer(client, model, [{"role": "user", "content": prompt}], {}, out, verbose)
    return 0
