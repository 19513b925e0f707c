"""The proxy's own Prometheus metrics (`kvrelay_proxy:*`), in a registry of its own."""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvrelay.proxy.routing import Backend

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0)
FREE_RESULTS = ("sent", "not_found", "rejected", "error")


class ProxyMetrics:
    """`kvrelay_proxy:*` metrics in a registry of this app's own."""

    def __init__(self, backends: list[Backend]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvrelay_proxy:requests",
                                "Client requests by endpoint and status returned.",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvrelay_proxy:backend_in_flight",
                               "Requests in flight per backend server.",
                               ["role", "backend"], registry=r)
        self.prefill_latency = Histogram("kvrelay_proxy:prefill_latency_seconds",
                                         "Prefill leg: request sent to response read.", ["backend"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.decode_latency = Histogram("kvrelay_proxy:decode_latency_seconds",
                                        "Decode leg: request sent to last byte relayed.",
                                        ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.failures = Counter("kvrelay_proxy:backend_failures",
                                "Backend attempts that failed, by reason.",
                                ["role", "backend", "reason"], registry=r)
        self.busy_retries = Counter("kvrelay_proxy:prefill_busy_retries",
                                    "Prefill answers 503 with Retry-After (busy: KV hold "
                                    "refused) that the proxy retried, per prefill server.",
                                    ["backend"], registry=r)
        self.healthy = Gauge("kvrelay_proxy:backend_healthy",
                             "1 when the backend's last background /health probe answered 200.",
                             ["role", "backend"], registry=r)
        self.free_notices = Counter("kvrelay_proxy:kv_free_notices",
                                    "Free notices sent to prefill servers after a failed decode.",
                                    ["result"], registry=r)
        self.decisions = Counter("kvrelay_proxy:routing_decisions",
                                 "Routing decisions: role prefill/decode (cache_hit, "
                                 "load_override, least_loaded, round_robin) and role disagg "
                                 "(prefill_then_decode, direct_to_decode).",
                                 ["role", "decision"], registry=r)
        self.table_blocks = Gauge("kvrelay_proxy:prefix_table_blocks",
                                  "Prompt blocks the router believes a backend holds.",
                                  ["role", "backend"], registry=r)
        self.forgotten = Counter("kvrelay_proxy:prefix_table_forgotten",
                                 "Times a backend's prefix-table entries were dropped, by reason "
                                 "(unhealthy, connect, restarted, missed_hits).",
                                 ["role", "backend", "reason"], registry=r)
        for result in FREE_RESULTS:
            self.free_notices.labels(result)
        for decision in ("prefill_then_decode", "direct_to_decode"):
            self.decisions.labels("disagg", decision)
        for b in backends:
            self.in_flight.labels(b.role, b.name).set(0)
            self.healthy.labels(b.role, b.name).set(1)
            (self.prefill_latency if b.role == "prefill" else self.decode_latency).labels(b.name)
            if b.role == "prefill":
                self.busy_retries.labels(b.name)

    def render(self) -> bytes:
        return generate_latest(self.registry)
