"""What every room of the engine's step reads (barrel.engine.engine): references the
engine sets once, at construction, and never replaces. Engine thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from barrel.engine.context import Batch, EngineOptions
from barrel.engine.model import LlamaModel
from barrel.engine.observer import EngineObserver
from barrel.engine.slots import SlotManager


@dataclass(frozen=True)
class Shared:
    """What every room of a step reads: the context, the model, the options, the batch and
    the slot manager (the only way to the KV cells)."""

    ctx: Any  # the llama_context
    model: LlamaModel
    options: EngineOptions
    n_ctx: int
    batch: Batch  # the step's batch, refilled every step
    kv: SlotManager  # the only way to the KV cells, but a decode
    observer: EngineObserver
    name: str
