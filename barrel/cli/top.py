"""`barrel top`: a live view of GET /api/status, refreshed every second."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from barrel.client import BarrelClient


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# (header, value) per column; the narrow view keeps the first and the starred ones
_COLUMNS: list[tuple[str, bool, Any]] = [
    ("MODEL", True, lambda m: m["name"]),
    ("STATE", True, lambda m: m.get("state", "")),
    ("CONTEXT", False, lambda m: str(m.get("context_length", ""))),
    ("MEMORY", False, lambda m: _bytes(m.get("size", 0))),
    ("RESIDENT", True, lambda m: _bytes(m.get("resident_bytes", 0))),
    ("ACTIVE", True, lambda m: str(m.get("running", 0))),
    ("QUEUED", True, lambda m: str(m.get("queued", 0))),
    ("TOK/S", True, lambda m: f"{m.get('tokens_per_s', 0.0):.1f}"),
    ("KV CELLS", False, lambda m: str(m.get("kv_cells_used", 0))),
    ("CACHE HIT", True, lambda m: f"{100 * m.get('cache_hit_ratio', 0.0):.0f}%"),
    ("EXPIRES", False, lambda m: m.get("expires_at") or "-"),
]
NARROW = 120  # below this many columns, the starred columns only


def _models(status: dict[str, Any], width: int | None) -> Table:
    columns = [c for c in _COLUMNS if c[1] or width is None or width >= NARROW]
    table = Table(title="Models", title_justify="left", expand=True)
    for header, _, _ in columns:
        table.add_column(header, no_wrap=True)
    for m in status.get("models", []):
        table.add_row(*(value(m) for _, _, value in columns))
    if not status.get("models"):
        table.add_row("(no model loaded)", *[""] * (len(columns) - 1))
    return table


def _recent(status: dict[str, Any]) -> Table:
    table = Table(title="Recent requests", title_justify="left", expand=True)
    for column in ("TIME", "REQUEST", "STATUS", "MS"):
        table.add_column(column, no_wrap=True)
    for r in status.get("recent_requests", [])[:10]:
        when = time.strftime("%H:%M:%S", time.localtime(r["time"]))
        style = "red" if r["status"] >= 500 else "yellow" if r["status"] >= 400 else ""
        table.add_row(
            when, f"{r['method']} {r['path']}", Text(str(r["status"]), style), str(r["duration_ms"])
        )
    return table


def _pulls(status: dict[str, Any]) -> RenderableType:
    pulls = status.get("pulls", [])
    if not pulls:
        return Text("Pulls: none in progress", style="dim")
    table = Table(title="Pulls", title_justify="left", expand=True)
    for column in ("MODEL", "STATUS", "PROGRESS"):
        table.add_column(column)
    for p in pulls:
        total, done = p.get("total") or 0, p.get("completed") or 0
        progress = f"{_bytes(done)} / {_bytes(total)}" if total else ""
        table.add_row(p["model"], str(p.get("status", "")), progress)
    return table


def _kv_states(status: dict[str, Any]) -> RenderableType:
    """Conversations saved on disk, per model (kept across unloads and restarts)."""
    states = status.get("kv_states", [])
    if not states:
        return Text("Saved conversations: none", style="dim")
    shown = ", ".join(f"{s['model']} {s['states']} ({_bytes(s['bytes'])})" for s in states)
    return Text(f"Saved conversations: {shown}")


def _tool_servers(status: dict[str, Any]) -> RenderableType:
    """The configured tool servers: their state, tools and restarts."""
    servers = status.get("tool_servers", [])
    if not servers:
        return Text("Tool servers: none configured", style="dim")
    shown = ", ".join(
        f"{s['name']} {s['state']} ({len(s['tools'])} tools"
        + (f", {s['restarts']} restarts" if s["restarts"] else "")
        + (f", {s['in_flight']} calls" if s["in_flight"] else "")
        + ")"
        for s in servers
    )
    return Text(f"Tool servers: {shown}")


def render_status(status: dict[str, Any], width: int | None = None) -> RenderableType:
    """One frame of `barrel top`; a `width` under NARROW drops the less urgent columns."""
    restarts = status.get("restarts", {})
    shown = ", ".join(f"{k} x{v}" for k, v in sorted(restarts.items())) or "none"
    head = Text(
        f"barrel {status.get('version', '?')}  up {status.get('uptime_s', 0):.0f}s  "
        f"supervisor restarts: {shown}",
        style="bold",
    )
    models = _models(status, width)
    parts = (_kv_states(status), _tool_servers(status), _pulls(status), _recent(status))
    return Group(head, models, *parts)


async def top(client: BarrelClient, console: Console, *, once: bool = False) -> None:
    if once:
        console.print(render_status(await client.status(), console.width))
        return
    with Live(console=console, refresh_per_second=4, screen=False) as live:
        while True:
            live.update(render_status(await client.status(), console.width))
            await asyncio.sleep(1.0)
