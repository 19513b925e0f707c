"""What the router reads from a backend's `GET /metrics` (vLLM's metric names, which
kvrelay serve exports too, so the proxy routes over vLLM servers the same way)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.proxy.routing import Backend

# sample name → Backend field; values of several engines (labels) are summed, except usage
# (averaged: it is a fraction per engine).
FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "kvrelay:kv_blocks_total": "kv_blocks_total",
}


@dataclass(frozen=True)
class Report:
    values: dict[str, float]       # Backend field → value (fields the server exports)


def parse(text: str) -> Report:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = FIELDS.get(sample.name)
            if name is not None:
                sums[name] = sums.get(name, 0.0) + float(sample.value)
                counts[name] = counts.get(name, 0) + 1
    if "kv_usage" in sums:
        sums["kv_usage"] /= counts["kv_usage"]
    return Report(sums)


def apply(backend: Backend, report: Report) -> bool:
    """Stores the report on the backend; True when the server restarted since the last one
    (its prefix-cache counters went backwards), so what it cached is gone."""
    v = report.values
    restarted = bool(backend.reported_at) and (
        v.get("prefix_queries", backend.prefix_queries) < backend.prefix_queries
        or v.get("prefix_hits", backend.prefix_hits) < backend.prefix_hits)
    backend.running = v.get("running", 0.0)
    backend.waiting = v.get("waiting", 0.0)
    backend.kv_usage = v.get("kv_usage", 0.0)
    backend.prefix_queries = v.get("prefix_queries", 0.0)
    backend.prefix_hits = v.get("prefix_hits", 0.0)
    backend.reported_at = time.monotonic()
    return restarted
