"""Prometheus metrics of one daemon.

Each daemon owns its own `CollectorRegistry` (no module-level singletons), so tests can
run several apps in one process.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from barrel import __version__

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

    # SupervisorObserver
    def child_restarted(self, child_id: str) -> None:
        self.restarts.labels(child=child_id).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
