"""`GET /metrics`: the server's Prometheus metrics, in a registry of its own (one per app, so several apps can live
in one process). Inter-token latency is the gap between two responses of a request: a DFlash iteration delivers
several tokens at once, and the acceptance-length histogram says how many."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "dflash_trt_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ACCEPTANCE_BUCKETS = tuple(float(n) for n in range(1, 17))
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of admitted requests", registry=registry)
        self.output_tokens = Counter(
            PREFIX + "generation_tokens", "output tokens the engine produced", registry=registry
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "request admitted to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "gap between two responses (iterations) of one request",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.acceptance_length = Histogram(
            PREFIX + "acceptance_length",
            "tokens per generation iteration of one request (the first token's iteration excluded)",
            buckets=ACCEPTANCE_BUCKETS,
            registry=registry,
        )
        self.running = Gauge(PREFIX + "requests_running", "requests in the executor", registry=registry)
        self.waiting = Gauge(PREFIX + "requests_waiting", "requests queued in the server", registry=registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
