"""Prometheus metrics of one daemon.

Each daemon owns its own `CollectorRegistry` (no module-level singletons), so tests can
run several apps in one process.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from barrel import __version__
from barrel.engine.types import Done

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        Info("barrel_build", "Barrel version", registry=self.registry).info(
            {"version": __version__}
        )
        self.restarts = Counter(
            "barrel_supervisor_restarts",
            "Children restarted by their supervisor",
            ["child"],
            registry=self.registry,
        )
        self.http_requests = Counter(
            "barrel_http_requests",
            "HTTP requests answered",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "barrel_http_request_duration_seconds",
            "Time from request to response headers (streams: to the end)",
            ["route"],
            registry=self.registry,
        )

        self.loads = Counter(
            "barrel_model_loads", "Model loads that succeeded", ["model"], registry=self.registry
        )
        self.engine = _EngineFamilies(self.registry)
        # What `barrel top` shows (GET /api/status), kept beside the Prometheus families.
        self.live: dict[str, LiveStats] = {}
        self.model_server = ModelServerCollector(self.live)
        self.registry.register(self.model_server)
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.restart_counts: dict[str, int] = defaultdict(int)
        self.started = time.time()
        self.template_render = Histogram(
            "barrel_pipeline_template_render_seconds",
            "Chat template rendering time",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
        )
        self.tool_calls = Counter(
            "barrel_tool_calls",
            "Calls of tool-server tools, by outcome (ok, error, timeout, failed, refused)",
            ["server", "tool", "outcome"],
            registry=self.registry,
        )
        self.tool_call_duration = Histogram(
            "barrel_tool_call_duration_seconds",
            "Time from a tool-server call to its result",
            ["server", "tool"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.output_parse = Histogram(
            "barrel_pipeline_output_parse_seconds",
            "Tool-call and reasoning parsing time per response",
            registry=self.registry,
            buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
        )

    def tool_call(self, server: str, tool: str, outcome: str, seconds: float) -> None:
        self.tool_calls.labels(server, tool, outcome).inc()
        self.tool_call_duration.labels(server, tool).observe(seconds)

    def watch_residency(self, resident: Callable[[], dict[str, int]]) -> None:
        """barrel_inference_resident_bytes{model}, read from /proc/self/smaps on each
        scrape (barrel.engine.residency.resident_bytes)."""
        self.registry.register(_ResidentCollector(resident))

    def engine_observer(self, model: str) -> EngineMetrics:
        """The observer an engine reports to, labelled with `model`."""
        live = self.live.setdefault(model, LiveStats())
        return EngineMetrics(self.engine, model, live)

    def kv_restored(self, model: str, tokens: int) -> None:
        """barrel.engine.kvdisk's `on_restored` (an engine thread)."""
        self.engine.restored_tokens.labels(model=model).inc(tokens)

    def pipeline_timings(self, render_s: float, parse_s: float) -> None:
        """The chat pipeline's `timings` callback."""
        self.template_render.observe(render_s)
        self.output_parse.observe(parse_s)

    # SupervisorObserver
    def child_restarted(self, child_id: str) -> None:
        self.restarts.labels(child=child_id).inc()
        self.restart_counts[child_id] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


RECENT_REQUESTS = 20
TPS_WINDOW_S = 5.0


class LiveStats:
    """One model's recent activity, written by its engine thread and read by the event
    loop (deque appends and int updates are atomic under the GIL)."""

    def __init__(self) -> None:
        self.token_times: deque[float] = deque(maxlen=8192)
        self.active = 0
        self.kv_cells = 0
        self.busy_cells = 0  # those of running sequences
        self.reused = 0
        self.computed = 0
        self.generated = 0
        self.requests = 0

    def tokens_per_s(self, now: float | None = None) -> float:
        """Generated tokens per second over the last TPS_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        recent = [t for t in list(self.token_times) if t >= now - TPS_WINDOW_S]
        if not recent:
            return 0.0
        return len(recent) / max(1.0, now - recent[0])

    def cache_hit_ratio(self) -> float:
        total = self.reused + self.computed
        return self.reused / total if total else 0.0


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineFamilies:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["model"], registry=registry, buckets=_LATENCY_BUCKETS)

        self.prompt_tokens = counter(
            "barrel_engine_prompt_tokens",
            "Prompt tokens, by whether they were computed or reused from the KV cache",
            ["model", "source"],
        )
        self.generated_tokens = counter(
            "barrel_engine_generated_tokens", "Tokens generated", ["model"]
        )
        self.requests = counter(
            "barrel_engine_requests", "Generations finished, by reason", ["model", "reason"]
        )
        self.draft_tokens = counter(
            "barrel_engine_draft_tokens", "Speculative draft tokens verified", ["model"]
        )
        self.draft_accepted = counter(
            "barrel_engine_draft_accepted_tokens",
            "Speculative draft tokens kept (equal to the token sampled there)",
            ["model"],
        )
        self.forced_tokens = counter(
            "barrel_engine_forced_tokens",
            "Tokens a grammar allowed as the only continuation, appended without sampling",
            ["model"],
        )
        self.restored_tokens = counter(
            "barrel_engine_restored_tokens",
            "Prompt tokens restored from states saved on disk when a model last stopped",
            ["model"],
        )
        self.turn_tokens = counter(
            "barrel_engine_next_turn_tokens",
            "Tokens of a template's next-turn header prefilled into an idle sequence",
            ["model"],
        )
        self.prefill = histogram("barrel_engine_prefill_duration_seconds", "Prompt prefill time")
        self.decode = histogram("barrel_engine_decode_duration_seconds", "Generation time")
        self.ttft = histogram("barrel_engine_time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("barrel_engine_inter_token_latency_seconds", "Time between tokens")
        self.step = histogram("barrel_engine_step_duration_seconds", "One llama_decode step")
        self.active = Gauge(
            "barrel_engine_active_sequences", "Sequences in flight", ["model"], registry=registry
        )
        self.kv_cells = Gauge(
            "barrel_engine_kv_cells_used",
            "KV cells held by sequences (running and parked)",
            ["model"],
            registry=registry,
        )


class EngineMetrics:
    """An `EngineObserver`: called from the engine thread (prometheus_client is
    thread-safe)."""

    def __init__(self, families: _EngineFamilies, model: str, live: LiveStats) -> None:
        self.live = live
        f = families
        self._computed = f.prompt_tokens.labels(model, "computed")
        self._reused = f.prompt_tokens.labels(model, "reused")
        self._generated = f.generated_tokens.labels(model)
        self._requests = f.requests
        self._model = model
        self._prefill = f.prefill.labels(model)
        self._decode = f.decode.labels(model)
        self._ttft = f.ttft.labels(model)
        self._itl = f.itl.labels(model)
        self._step = f.step.labels(model)
        self._active = f.active.labels(model)
        self._kv = f.kv_cells.labels(model)
        self._drafted = f.draft_tokens.labels(model)
        self._accepted = f.draft_accepted.labels(model)
        self._turn_tokens = f.turn_tokens.labels(model)
        self._forced = f.forced_tokens.labels(model)

    def step(self, tokens: int, active: int, kv_cells: int, seconds: float) -> None:
        self._step.observe(seconds)

    def occupancy(self, active: int, kv_cells: int, busy_cells: int) -> None:
        self._active.set(active)
        self._kv.set(kv_cells)
        self.live.active, self.live.kv_cells, self.live.busy_cells = active, kv_cells, busy_cells

    def drafted(self, drafted: int, accepted: int) -> None:
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)

    def next_turn(self, tokens: int) -> None:
        self._turn_tokens.inc(tokens)

    def forced(self, tokens: int) -> None:
        self._forced.inc(tokens)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)
        self.live.token_times.append(time.monotonic())

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)
        self.live.token_times.append(time.monotonic())

    def finished(self, done: Done) -> None:
        usage, timings = done.usage, done.timings
        self._requests.labels(self._model, done.finish_reason.value).inc()
        self._computed.inc(usage.prompt_computed)
        self._reused.inc(usage.prompt_reused)
        self._generated.inc(usage.completion_tokens)
        live = self.live
        live.reused += usage.prompt_reused
        live.computed += usage.prompt_computed
        live.generated += usage.completion_tokens
        live.requests += 1
        if timings.prefill_s > 0:
            self._prefill.observe(timings.prefill_s)
        if timings.decode_s > 0:
            self._decode.observe(timings.decode_s)


class _ResidentCollector(Collector):
    def __init__(self, resident: Callable[[], dict[str, int]]) -> None:
        self.resident = resident

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "barrel_inference_resident_bytes",
            "Bytes of a loaded model's memory-mapped weights now in RAM (mincore)",
            labels=["model"],
        )
        for model, value in sorted(self.resident().items()):
            family.add_metric([model], value)
        yield family


# llama.cpp's KV cache has no pages: one cell holds one token, so a "block" is one token
# and the cache has n_ctx of them.
KV_BLOCK_TOKENS = 1


class ModelServerCollector(Collector):
    """The model-server metrics protocol that gateways route by (vLLM's names, read by
    SMG's load monitor and llm-d's endpoint picker), one series per model
    (`model_name`): every servable model, an unloaded one at zero load (a router reads
    a missing KV-usage gauge as "load unknown"). The queue depths and contexts come from
    the last `loaded()` call (the /metrics handler makes one before each scrape); the
    rest is live."""

    def __init__(self, live: dict[str, LiveStats]) -> None:
        self.live = live
        self._loaded: list[tuple[str, int, int]] = []  # (model, waiting, n_ctx)
        self._idle: list[str] = []

    def loaded(self, models: list[tuple[str, int, int]], servable: list[str]) -> None:
        """The loaded models (name, requests waiting, context) and every servable name."""
        self._loaded = list(models)
        names = {m[0] for m in models}
        self._idle = sorted(n for n in set(servable) if n not in names)

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["model_name", *labels])

        waiting = gauge("vllm:num_requests_waiting", "Requests queued for a sequence")
        running = gauge("vllm:num_requests_running", "Sequences generating or prefilling")
        usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means full)")
        usage_old = gauge("vllm:gpu_cache_usage_perc", "KV cache usage (1 means full)")
        config = gauge(
            "vllm:cache_config_info",
            "KV cache configuration (a block is one token: llama.cpp's cells)",
            ("block_size", "num_gpu_blocks"),
        )
        for model, queued, n_ctx in self._loaded:
            live = self.live.get(model)
            # running sequences' cells: parked conversations and pinned prefixes give
            # way to new work, as vLLM's free prefix-cache blocks do
            active, cells = (live.active, live.busy_cells) if live else (0, 0)
            share = min(1.0, cells / n_ctx) if n_ctx > 0 else 0.0
            waiting.add_metric([model], queued)
            running.add_metric([model], active)
            usage.add_metric([model], share)
            usage_old.add_metric([model], share)
            config.add_metric([model, str(KV_BLOCK_TOKENS), str(n_ctx)], 1)
        for model in self._idle:
            for family in (waiting, running, usage, usage_old):
                family.add_metric([model], 0)
        yield from (waiting, running, usage, usage_old, config)
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the KV cache",
            labels=["model_name"],
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prompt tokens found in the KV cache", labels=["model_name"]
        )
        for model, live in sorted(self.live.items()):
            queries.add_metric([model], live.reused + live.computed)
            hits.add_metric([model], live.reused)
        yield queries
        yield hits
