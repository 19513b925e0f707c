"""Prometheus metrics with vLLM's names (so dashboards and routers work) plus kvrelay's own.

Engine gauges/totals are read from the engine core's latest stats snapshot at scrape
time; latency histograms and token counters are observed by the API server. What the
engine core resolved at start-up (native CPU kernels, the half-precision matmul path)
comes with its "ready" info (`kvrelay.model.fast_paths.native_paths`; sent again when the
kernels, built in the background, switch in) and is exported from there, so it costs
nothing per step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


def native_families(native: dict[str, Any], labels: list[str],
                    values: list[str]) -> Iterator[GaugeMetricFamily]:
    """`kvrelay:native_kernels_available{kernel, isa}` 1 where the native CPU kernel serves
    `kernel` (isa: the ISA build it runs), 0 where the PyTorch reference path does (isa
    "none"); `kvrelay:native_kernels_ready` / `_building` (the build: done and in use /
    compiling in the background; both 0 when it failed); `kvrelay:half_matmul_path{path}`
    1 on the path bf16/fp16 matmuls take."""
    kernels = GaugeMetricFamily(
        "kvrelay:native_kernels_available",
        "1 if the native CPU kernel serves this kernel, 0 if the PyTorch reference path does "
        "(the build failed, see the log's warning, or an env var turned it off).",
        labels=labels + ["kernel", "isa"])
    for kernel, isa in sorted(native.get("kernels", {}).items()):
        kernels.add_metric(values + [kernel, isa or "none"], 1.0 if isa else 0.0)
    yield kernels
    build = native.get("build")
    if build:
        for state in ("ready", "building"):
            gauge = GaugeMetricFamily(
                f"kvrelay:native_kernels_{state}",
                "1 once the native CPU kernels are built and in use" if state == "ready" else
                "1 while the native CPU kernels compile in the background (the PyTorch "
                "reference paths serve meanwhile; the log shows the progress)", labels=labels)
            gauge.add_metric(values, 1.0 if build == state else 0.0)
            yield gauge
    chosen = native.get("half_matmul")
    if chosen:
        path = GaugeMetricFamily(
            "kvrelay:half_matmul_path",
            "1 on the path bf16/fp16 matmuls take on this CPU: native (oneDNN bf16) or fp32 "
            "compute (no native bf16 arithmetic).", labels=labels + ["path"])
        for name in ("native", "fp32"):
            path.add_metric(values + [name], 1.0 if name == chosen else 0.0)
        yield path


def spec_decode_families(s: Mapping[str, Any], labels: list[str],
                         values: list[str]) -> Iterator[CounterMetricFamily]:
    """vLLM's speculative decoding counters (--speculative-config): drafts verified, their
    tokens, the tokens accepted, and per draft position j the drafts accepted at j
    (`position` label, 0-based). Acceptance rate: accepted / draft tokens; mean accepted
    length: 1 + accepted / drafts."""
    for name, key, doc in (
            ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts",
             "Drafts verified (steps of a request that carried draft tokens)."),
            ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
             "Draft tokens proposed."),
            ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
             "Draft tokens accepted.")):
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, s[key])
        yield c
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at this position was accepted.",
                                  labels=labels + ["position"])
    for j, count in enumerate(s.get("spec_decode_accepted_per_pos") or ()):
        per_pos.add_metric(values + [str(j)], count)
    yield per_pos


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str,
                 info: Callable[[], Mapping[str, Any] | None] | None = None) -> None:
        self.stats, self.model_name, self.info = stats, model_name, info

    def collect(self) -> Iterator:
        s = self.stats() or {}
        labels = ["model_name", "engine"]
        values = [self.model_name, "0"]
        native = (self.info() or {}).get("native") if self.info else None
        if native:
            yield from native_families(native, labels, values)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    s.get("num_requests_running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    s.get("num_requests_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    s.get("kv_cache_usage_perc", 0))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.get("prefix_cache_hits", 0))
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed later).",
                      s.get("num_preemptions", 0))
        yield gauge("kvrelay:kv_blocks_free", "Free KV blocks (cached ones included).",
                    s.get("blocks_free", 0))
        yield gauge("kvrelay:kv_blocks_used", "KV blocks held by requests.",
                    s.get("blocks_used", 0))
        yield gauge("kvrelay:kv_blocks_total", "Usable KV blocks.", s.get("blocks_total", 0))
        yield counter("kvrelay:engine_steps", "Engine steps run.", s.get("num_steps", 0))
        if "spec_decode_num_drafts" in s:
            yield from spec_decode_families(s, labels, values)
        if "dp_dummy_steps" in s:
            yield counter("kvrelay:dp_dummy_steps", "Forwards of an idle replica so that experts "
                          "spanning data-parallel replicas step in lockstep.", s["dp_dummy_steps"])
        if "kv_transfers" in s:
            yield counter("kvrelay:kv_transfers", "KV loads completed (decode side).",
                          s["kv_transfers"])
            yield counter("kvrelay:kv_transfer_failures", "KV loads that failed.",
                          s["kv_transfer_failures"])
            yield counter("kvrelay:kv_transfer_bytes", "Bytes of KV pulled.",
                          s["kv_transfer_bytes"])
            yield counter("kvrelay:kv_transfer_seconds", "Seconds spent pulling KV.",
                          s["kv_transfer_seconds"])
            yield counter("kvrelay:kv_handshakes", "Side-channel handshakes done.",
                          s["kv_handshakes"])
            yield counter("kvrelay:kv_handshake_errors", "Side-channel handshakes refused.",
                          s["kv_handshake_errors"])
            yield gauge("kvrelay:kv_transport_fallback", "1 if the requested KV backend fell back.",
                        s["kv_transport_fallbacks"])
            yield gauge("kvrelay:kv_blocks_held_for_remote",
                        "Blocks kept for decode servers (prefill).", s["kv_blocks_held_for_remote"])
            yield gauge("kvrelay:kv_requests_held_for_remote",
                        "Requests whose KV awaits a decode read.", s["kv_requests_held_for_remote"])
            yield counter("kvrelay:kv_leases_expired", "Held requests freed by lease expiry.",
                          s["kv_leases_expired"])
            yield counter("kvrelay:kv_read_done_notices",
                          "Held requests freed by decode's read-done notice.",
                          s["kv_read_done_notices"])


class _AdmissionCollector(Collector):
    """The API process's admission count (server/admission.py), read at scrape time."""

    def __init__(self, admission: Any, model_name: str) -> None:
        self.admission, self.model_name = admission, model_name

    def collect(self) -> Iterator:
        queued = GaugeMetricFamily(
            "kvrelay:admission_queued_sequences", "Sequences admitted beyond those the engine "
            "runs at once (bounded by --max-queued-requests).", labels=["model_name"])
        queued.add_metric([self.model_name], self.admission.queued)
        yield queued
        refused = CounterMetricFamily(
            "kvrelay:requests_refused_queue_full", "Requests answered 503 because the queue "
            "was full.", labels=["model_name"])
        refused.add_metric([self.model_name], self.admission.refused)
        yield refused


class ServerMetrics:
    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str,
                 info: Callable[[], Mapping[str, Any] | None] | None = None,
                 admission: Any = None) -> None:
        """`stats`: the engine's latest per-step snapshot; `info`: its start-up "ready" info;
        `admission`: the API process's `Admission` (its queue count and refusals)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(stats, model_name, info))
        if admission is not None:
            self.registry.register(_AdmissionCollector(admission, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished requests by reason.",
                                       labels + ["finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
