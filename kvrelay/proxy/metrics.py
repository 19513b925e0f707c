"""The proxy's own Prometheus metrics (`kvrelay_proxy:*`), in a registry of its own."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from kvrelay.proxy.routing import Backend

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0)
FREE_RESULTS = ("sent", "not_found", "rejected", "error")
BACKEND_STATES = ("active", "unready", "draining")


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
            self.add(b)

    def add(self, b: Backend) -> None:
        """A backend's series, at zero (its health as the proxy believes it)."""
        self.in_flight.labels(b.role, b.name).set(0)
        self.healthy.labels(b.role, b.name).set(int(b.healthy))
        (self.prefill_latency if b.role == "prefill" else self.decode_latency).labels(b.name)
        if b.role == "prefill":
            self.busy_retries.labels(b.name)

    def remove(self, b: Backend) -> None:
        """Every series labelled with a backend that is gone (drained and dropped)."""
        for gauge in (self.in_flight, self.healthy, self.table_blocks):
            remove_series(gauge, ("role", "backend"), (b.role, b.name))
        for counter in (self.failures, self.forgotten):
            remove_series(counter, ("role", "backend", "reason"), (b.role, b.name))
        latency = self.prefill_latency if b.role == "prefill" else self.decode_latency
        remove_series(latency, ("backend",), (b.name,))
        if b.role == "prefill":
            remove_series(self.busy_retries, ("backend",), (b.name,))

    def follow(self, members: Callable[[], Iterable[Backend]]) -> None:
        """`kvrelay_proxy:backends` and `kvrelay_proxy:backend_info` from `members()` (every
        backend the proxy holds, draining ones included), read at each scrape."""
        self.registry.register(_BackendSet(members))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def remove_series(metric: MetricWrapperBase, names: tuple[str, ...],
                  leading: tuple[str, ...]) -> None:
    """Drop the children of `metric` (label names `names`) whose first labels are `leading`,
    whatever the rest (prometheus_client's `remove_by_labels` is too recent to rely on)."""
    found = {values for family in metric.collect() for s in family.samples
             if (values := tuple(s.labels.get(n, "") for n in names))[:len(leading)] == leading}
    for values in found:
        try:
            metric.remove(*values)
        except KeyError:                 # not a child (a sample of another shape)
            pass


class _BackendSet(Collector):
    """How many backends of each role are in each state, and which backend is which."""

    def __init__(self, members: Callable[[], Iterable[Backend]]) -> None:
        self.members = members

    def collect(self) -> Iterator[Metric]:
        counts = GaugeMetricFamily(
            "kvrelay_proxy:backends", "Backends by role and state: active (takes requests), "
            "unready (added, no healthy /health yet), draining (removed, requests still in "
            "flight or holding it).", labels=["role", "state"])
        info = GaugeMetricFamily(
            "kvrelay_proxy:backend_info", "1 for each backend the proxy holds, with its id "
            "(the backends file's) and state; a removed backend's series goes once it is "
            "drained: nothing in flight, no decode still pulling its KV.",
            labels=["role", "backend", "id", "state"])
        n = {(role, state): 0 for role in ("prefill", "decode") for state in BACKEND_STATES}
        for b in self.members():
            n[(b.role, b.state)] += 1
            info.add_metric([b.role, b.name, b.id, b.state], 1.0)
        for (role, state), count in n.items():
            counts.add_metric([role, state], float(count))
        yield counts
        yield info
