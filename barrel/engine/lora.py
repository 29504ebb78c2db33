"""The context's LoRA adapters and the scales each step runs under. llama.cpp sets
adapters per context, so sequences of different scales never share a step: each step
takes the setting that has waited longest among the runnable sequences. `check` runs
in the submitting thread; everything else in the engine thread."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import llama_cpp as ll

from barrel.engine.context import set_lora_scales
from barrel.engine.run import Run
from barrel.engine.types import EngineRequest
from barrel.errors import InvalidRequest

# The largest LoRA scale a request may set (llama-server takes any float; a huge one
# only makes noise).
LORA_SCALE_MAX = 100.0

Scales = tuple[float, ...]


class Loras:
    """Owns the context's LoRA adapters and the scales set on it now; a step runs sequences
    of one setting."""

    def __init__(self, ctx: Any, adapters: list[Any], default: Scales) -> None:
        self.ctx = ctx
        self.adapters = adapters
        self.default = default  # the load-time scales
        self.now = default  # set on the context now
        # when each setting last ran (a count of steps planned): clients choose the
        # scales, so it keeps only the settings still wanted
        self.served: dict[Scales, int] = {}
        self._ticks = 0

    def check(self, req: EngineRequest) -> EngineRequest:
        """`req` with its LoRA scales checked, and a KV scope of their own when they
        differ from the load-time scales (cells computed under other adapters are not
        this request's). Any thread."""
        if req.lora is None:
            return req
        n = len(self.default)
        if len(req.lora) != n:
            raise InvalidRequest(f"lora: this model has {n} adapters", param="lora")
        if any(not math.isfinite(s) or abs(s) > LORA_SCALE_MAX for s in req.lora):
            raise InvalidRequest(
                f"lora: scales must be finite, at most {LORA_SCALE_MAX:g} in size", param="lora"
            )
        if req.lora == self.default:
            return dataclasses.replace(req, lora=None)
        tag = ",".join(f"{s:g}" for s in req.lora)
        return dataclasses.replace(req, scope=f"{req.scope}|lora={tag}")

    def of(self, run: Run) -> Scales:
        return run.req.lora if run.req.lora is not None else self.default

    def for_step(self, runnable: Iterable[Run], pinning: bool) -> Scales:
        """Choose this step's scales (pinned prefixes are computed under the load-time
        scales) and set them on the context."""
        self._ticks += 1
        wanted = {self.of(r) for r in runnable}
        if pinning:
            wanted.add(self.default)
        if self.served.keys() - wanted:
            self.served = {k: v for k, v in self.served.items() if k in wanted}
        chosen = self.now
        if wanted and wanted != {self.now}:
            chosen = min(wanted, key=lambda scales: self.served.get(scales, -1))
        self.use(chosen)
        self.served[chosen] = self._ticks
        return chosen

    def use(self, scales: Scales) -> None:
        if scales != self.now:
            set_lora_scales(self.ctx, self.adapters, scales)
            self.now = scales

    def free(self) -> None:
        for adapter in self.adapters:
            ll.llama_adapter_lora_free(adapter)
        self.adapters = []
