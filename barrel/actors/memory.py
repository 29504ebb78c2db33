"""Memory-aware loading: what a model will take, and what the machine can give.

estimate = GGUF file size + KV cache at the effective context (2 x layers x context x
KV heads x head size x bytes per element of the KV type) + a compute margin.
available = the most restrictive of MemAvailable, the cgroup (v2) limit minus usage, and
an explicit budget when configured (`models.memory_budget_bytes`). No GPU backend is
built here, so free GPU memory does not enter it yet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from barrel.errors import Unavailable

KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


class ModelWouldOOM(Unavailable):
    code = "model_would_oom"


def kv_cache_bytes(meta: dict[str, Any], n_ctx: int, kv_type: str = "f16") -> int:
    layers = int(meta.get("block_count") or 0)
    heads_kv = int(meta.get("head_count_kv") or 0)
    heads = int(meta.get("head_count") or heads_kv or 1)
    embd = int(meta.get("embedding_length") or 0)
    head_dim = embd // heads if heads else 0
    return int(2 * layers * n_ctx * heads_kv * head_dim * KV_BYTES.get(kv_type, 2.0))


def estimate(file_size: int, meta: dict[str, Any], n_ctx: int, kv_type: str, margin: int) -> int:
    return file_size + kv_cache_bytes(meta, n_ctx, kv_type) + margin


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def available_bytes(budget: int = 0) -> int:
    candidates = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
    if budget > 0:
        candidates.append(budget)
    return min(candidates) if candidates else 1 << 62


def planner(
    budget: int, idle_lru: list[str], in_use_by_budget: bool
) -> Callable[[Any, list[tuple[str, int]]], list[str]]:
    """A loader `plan`: which idle models to unload so `spec` fits, else ModelWouldOOM.

    With an explicit budget the loaded models' estimates count against it; against the
    machine's free memory they are already accounted for by the kernel."""

    def plan(spec: Any, loaded: list[tuple[str, int]]) -> list[str]:
        free = available_bytes(budget)
        used = dict(loaded)
        if in_use_by_budget:
            free = budget - sum(used.values()) if budget > 0 else free
        victims: list[str] = []
        for name in idle_lru:
            if spec.estimate_bytes <= free:
                break
            if name in used and name != spec.name:
                victims.append(name)
                free += used[name]
        if spec.estimate_bytes > free:
            raise ModelWouldOOM(
                f"model {spec.name} needs about {spec.estimate_bytes >> 20} MiB; "
                f"{max(free, 0) >> 20} MiB can be made free without stopping a busy model",
                retry_after=5.0,
            )
        return victims

    return plan
