"""Per-request results → the benchmark's metrics (vLLM `bench serve`'s definitions).

Definitions, for one successful request sent at time s whose streamed chunks arrive at
t_1 < t_2 < … < t_k and which produced `output_len` tokens in all:

    TTFT = t_1 - s                      time to the first chunk carrying text
    ITL  = [t_2 - t_1, …, t_k - t_{k-1}] one value per later chunk (a chunk may carry >1 token)
    E2EL = end of the response - s
    TPOT = (E2EL - TTFT) / (output_len - 1)   only when output_len > 1: the first token is excluded

Throughputs divide by the benchmark's wall-clock duration and count successful requests
only. Goodput counts the requests that meet every SLO given (`--goodput ttft:MS ...`); a
request with a single output token has no TPOT and passes a TPOT SLO.
Percentiles interpolate linearly between order statistics (numpy's default), std is the
population standard deviation (numpy's default), so numbers match vLLM's.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """What the client measured for one request (times in seconds)."""

    success: bool = False
    prompt_len: int = 0              # tokens: the server's usage, else the dataset's count
    output_len: int = 0              # tokens: the server's usage, else a tokenizer/chunk count
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0             # E2EL
    start_time: float = 0.0          # seconds since the benchmark started
    chunk_times: list[float] = field(default_factory=list)  # arrival of each text chunk, same clock
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class Summary:
    """mean / median / std / percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between order statistics (numpy's default "linear" method).

    Sorted values v_0 … v_{n-1}; rank r = p/100 · (n-1); result v_⌊r⌋ + (r-⌊r⌋)(v_⌈r⌉ - v_⌊r⌋).
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    if not values:
        return 0.0
    v = sorted(values)
    rank = p / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (rank - lo) * (v[hi] - v[lo])


def summarize(values_s: list[float], percentiles: list[float]) -> Summary:
    """Seconds in, milliseconds out. An empty list summarises to zeros (as vLLM reports)."""
    ms = [x * 1000.0 for x in values_s]
    if not ms:
        return Summary(0.0, 0.0, 0.0, dict.fromkeys(percentiles, 0.0))
    return Summary(statistics.fmean(ms), statistics.median(ms), statistics.pstdev(ms),
                   {p: percentile(ms, p) for p in percentiles})


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] → {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes NAME:MS with NAME in ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of "
                             "milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    tpot = r.tpot or 0.0
    measured = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos.items())


def output_timeline(results: list[RequestResult], duration: float,
                    bucket_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive buckets of `bucket_s` seconds.

    Each successful request's `output_len` tokens are spread over its chunks (a chunk of a
    request whose usage says more tokens than it sent chunks counts for several)."""
    n = max(1, math.ceil(duration / bucket_s)) if duration > 0 else 1
    counts = [0.0] * n
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        for t in r.chunk_times:
            counts[min(n - 1, max(0, int(t / bucket_s)))] += per_chunk
    return [c / bucket_s for c in counts]


def peak_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (start … start + latency, successful or not)."""
    events = []
    for r in results:
        events.append((r.start_time, 1))
        events.append((r.start_time + r.latency, -1))
    peak = cur = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):    # ends before starts at a tie
        cur += delta
        peak = max(peak, cur)
    return peak


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    summaries: dict[str, Summary]    # "ttft" | "tpot" | "itl" | "e2el"


def compute_metrics(results: list[RequestResult], duration: float, percentiles: list[float],
                    slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    ok = [r for r in results if r.success]
    if duration <= 0:
        raise ValueError("benchmark duration must be > 0")
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    goodput = None
    if slos:
        goodput = sum(meets_slos(r, slos) for r in ok) / duration
    timeline = output_timeline(results, duration)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / duration, request_goodput=goodput,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=max(timeline) if timeline else 0.0,
        max_concurrent_requests=peak_concurrency(results),
        summaries={name: summarize(series[name], percentiles) for name in METRIC_NAMES})
