"""The client-side subcommands: each talks to the daemon through `barrel.client`.

A daemon that cannot be reached is one line on stderr saying how to start it, exit 1;
an error answer is "Error: <message>", exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from barrel import __version__
from barrel.cli.chat import run_model
from barrel.cli.top import top
from barrel.client import ApiError, BarrelClient, DaemonUnreachable
from barrel.store import modelfile as mf

ALIASES = {"ls": "list", "unload": "stop"}

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _ago(iso: str) -> str:
    try:
        then = time.mktime(time.strptime(iso[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    except ValueError:
        return iso
    seconds = max(0, time.time() - then)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def _table(*columns: str) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=True)
    return table


async def _list(c: BarrelClient, _args: argparse.Namespace) -> int:
    table = _table("NAME", "ID", "SIZE", "MODIFIED")
    for m in await c.list_models():
        table.add_row(
            m["name"], (m.get("digest") or "")[:12], _size(m["size"]), _ago(m["modified_at"])
        )
    out.print(table)
    return 0


async def _ps(c: BarrelClient, _args: argparse.Namespace) -> int:
    table = _table("NAME", "SIZE", "CONTEXT", "RUNNING", "QUEUED", "UNTIL")
    for m in await c.ps():
        table.add_row(
            m["name"],
            _size(m["size"]),
            str(m.get("context_length", "")),
            str(m.get("running", 0)),
            str(m.get("queued", 0)),
            m.get("expires_at") or "forever",
        )
    out.print(table)
    return 0


async def _show(c: BarrelClient, args: argparse.Namespace) -> int:
    info = await c.show(args.model)
    for part in ("modelfile", "parameters", "template", "system", "license"):
        if getattr(args, part):
            value = info.get(part) or ""
            out.print(value if isinstance(value, str) else "\n".join(value), markup=False)
            return 0
    details = info.get("details", {})
    table = _table("", "")
    table.add_row("architecture", str(details.get("family", "")))
    table.add_row("parameters", str(details.get("parameter_size", "")))
    table.add_row("quantization", str(details.get("quantization_level", "")))
    model_info = info.get("model_info", {})
    for key, value in model_info.items():
        if key.endswith((".context_length", ".embedding_length")):
            table.add_row(key.rsplit(".", 1)[1].replace("_", " "), str(value))
    if info.get("capabilities"):
        table.add_row("capabilities", ", ".join(info["capabilities"]))
    out.print("  Model")
    out.print(table)
    if info.get("parameters"):
        out.print("\n  Parameters")
        out.print(info["parameters"], markup=False)
    return 0


async def _rm(c: BarrelClient, args: argparse.Namespace) -> int:
    for model in args.models:
        await c.delete(model)
        out.print(f"deleted '{model}'")
    return 0


async def _cp(c: BarrelClient, args: argparse.Namespace) -> int:
    await c.copy(args.source, args.destination)
    out.print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def _modelfile_text(path: Path) -> str:
    """The Modelfile, with a relative FROM path made absolute (it is relative to the
    Modelfile, not to the daemon)."""
    text = path.read_text()
    spec = mf.parse(text)
    source = Path(spec.from_).expanduser()
    if spec.from_ and not source.is_absolute() and (path.parent / source).exists():
        absolute = str((path.parent / source).resolve())
        text = "\n".join(
            f"FROM {absolute}" if line.strip().upper().startswith("FROM ") else line
            for line in text.splitlines()
        )
    return text


async def _create(c: BarrelClient, args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        text = _modelfile_text(path)
    except OSError as exc:
        err.print(f"Error: cannot read {path}: {exc.strerror}")
        return 1
    async for event in c.create(args.model, text):
        if event.get("status"):
            out.print(event["status"])
    return 0


async def _edit(c: BarrelClient, args: argparse.Namespace) -> int:
    params: dict[str, Any] = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            err.print(f"Error: expected NAME=VALUE, got {item!r}")
            return 1
        params[name] = value
    if not params:
        err.print("Error: nothing to set (use --set NAME=VALUE)")
        return 1
    await c.edit(args.model, params)
    out.print(f"updated '{args.model}': {', '.join(params)}")
    return 0


async def _search(c: BarrelClient, args: argparse.Namespace) -> int:
    table = _table("NAME", "SOURCE")
    for m in await c.search(args.query):
        table.add_row(m["name"], m.get("registry") or m.get("source", ""))
    out.print(table)
    return 0


async def _pull(c: BarrelClient, args: argparse.Namespace) -> int:
    await _pull_model(c, args.model, args.insecure)
    return 0


async def _pull_model(c: BarrelClient, model: str, insecure: bool = False) -> None:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    tasks: dict[str, TaskID] = {}
    with Progress(*columns, console=err, transient=False) as progress:
        async for event in c.pull(model, insecure=insecure):
            digest, total = event.get("digest"), event.get("total")
            if digest and total:
                if digest not in tasks:
                    label = f"pulling {digest.removeprefix('sha256:')[:12]}"
                    tasks[digest] = progress.add_task(label, total=total)
                progress.update(tasks[digest], completed=event.get("completed", 0))
            elif event.get("status"):
                progress.console.print(event["status"])


async def _run(c: BarrelClient, args: argparse.Namespace) -> int:
    try:
        await c.show(args.model)
    except ApiError as exc:
        if exc.status != 404:
            raise
        await _pull_model(c, args.model)  # as Ollama's CLI does: pull, then run
    prompt = " ".join(args.prompt) if args.prompt else None
    return await run_model(c, args.model, prompt, args.verbose)


async def _embed(c: BarrelClient, args: argparse.Namespace) -> int:
    for vector in await c.embed(args.model, list(args.inputs)):
        print(json.dumps(vector))
    return 0


async def _stop(c: BarrelClient, args: argparse.Namespace) -> int:
    await c.unload(args.model)
    draining = [m for m in await c.ps() if m.get("state") == "draining"]
    if any(args.model in (m["name"], m["name"].removesuffix(":latest")) for m in draining):
        out.print(f"stopping '{args.model}': it unloads when its requests in flight end")
    else:
        out.print(f"unloaded '{args.model}'")
    return 0


async def _prune(c: BarrelClient, _args: argparse.Namespace) -> int:
    result = await c.prune()
    blobs, partials = len(result.get("removed_blobs", [])), result.get("removed_partials", 0)
    out.print(f"removed {blobs} unused blobs and {partials} partial downloads")
    return 0


async def _top(c: BarrelClient, args: argparse.Namespace) -> int:
    await top(c, out, once=args.once)
    return 0


async def _version(c: BarrelClient, _args: argparse.Namespace) -> int:
    out.print(f"barrel client {__version__}")
    try:
        out.print(f"barrel daemon {await c.version()} at {c.url}")
    except DaemonUnreachable:
        out.print(f"no daemon at {c.url}")
    return 0


COMMANDS: dict[str, Callable[[BarrelClient, argparse.Namespace], Awaitable[int]]] = {
    "list": _list,
    "ps": _ps,
    "show": _show,
    "rm": _rm,
    "cp": _cp,
    "create": _create,
    "edit": _edit,
    "search": _search,
    "pull": _pull,
    "run": _run,
    "embed": _embed,
    "stop": _stop,
    "prune": _prune,
    "top": _top,
    "version": _version,
}


async def _main(args: argparse.Namespace) -> int:
    command = COMMANDS[ALIASES.get(args.command, args.command)]
    async with BarrelClient(args.host) as client:
        return await command(client, args)


def dispatch(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except DaemonUnreachable as exc:
        err.print(
            f"barrel: cannot reach the daemon at {exc.url}; start it with `barrel serve` "
            "(or point BARREL_HOST at it)"
        )
        return 1
    except ApiError as exc:
        err.print(f"Error: {exc.message}", markup=False)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["dispatch"]
