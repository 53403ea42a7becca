"""Prometheus metrics (prefix moe_offload_, base units, _total counters, 0-1 ratios).

Front-end metrics are ordinary prometheus-client objects in a per-app registry (no global
singletons).  Engine metrics come from the latest EngineStats snapshot the engine process
sent, exported by a custom Collector (server/engine_metrics.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.engine_metrics import EngineStatsCollector, P

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = EngineStatsCollector()
        r.register(self.engine)
        self.running = Gauge(
            P + "requests_running", "Requests in the engine's running batch.", registry=r
        )
        self.waiting = Gauge(
            P + "requests_waiting", "Requests queued in the engine, not yet scheduled.", registry=r
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(
            P + "requests_finished",
            "Sequences finished, by finish_reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Arrival in the engine to first scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
