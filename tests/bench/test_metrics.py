"""Metric computations against hand-computed cases."""
from __future__ import annotations

import math

import pytest

from kvrelay.bench.metrics import (
    RequestResult,
    compute_metrics,
    meets_slos,
    output_timeline,
    parse_goodput,
    peak_concurrency,
    percentile,
    summarize,
)


def ok(ttft: float, latency: float, out: int, prompt: int = 10, itl: list[float] | None = None,
       start: float = 0.0, chunks: list[float] | None = None) -> RequestResult:
    return RequestResult(success=True, prompt_len=prompt, output_len=out, ttft=ttft,
                         latency=latency, itl=itl or [], start_time=start, chunk_times=chunks or [])


def test_percentile_interpolates_linearly_like_numpy():
    v = [4.0, 1.0, 3.0, 2.0]                  # sorted 1 2 3 4; rank = p/100 * 3
    assert percentile(v, 0) == 1.0
    assert percentile(v, 100) == 4.0
    assert percentile(v, 50) == pytest.approx(2.5)          # rank 1.5
    assert percentile(v, 90) == pytest.approx(3.7)          # rank 2.7: 3 + 0.7 * 1
    assert percentile(v, 99) == pytest.approx(3.97)         # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(v, 101)


def test_summarize_is_in_ms_with_population_std():
    s = summarize([0.001, 0.002, 0.003, 0.006], [50, 99])
    assert s.mean == pytest.approx(3.0)
    assert s.median == pytest.approx(2.5)
    assert s.std == pytest.approx(math.sqrt(((2 ** 2) + 1 + 0 + 9) / 4))    # deviations -2 -1 0 3
    assert s.percentiles[50] == pytest.approx(2.5)
    assert s.percentiles[99] == pytest.approx(3 + 0.97 * 3)                 # rank 2.97 of 1 2 3 6
    empty = summarize([], [99])
    assert (empty.mean, empty.median, empty.std, empty.percentiles) == (0.0, 0.0, 0.0, {99: 0.0})


def test_tpot_excludes_the_first_token():
    r = ok(ttft=0.5, latency=1.5, out=11)           # 10 tokens after the first in 1.0 s
    assert r.tpot == pytest.approx(0.1)
    assert ok(ttft=0.5, latency=0.5, out=1).tpot is None
    assert RequestResult(success=False, output_len=5, latency=1).tpot is None


def test_compute_metrics_by_hand():
    results = [
        ok(ttft=0.1, latency=1.1, out=11, prompt=100, itl=[0.1] * 10),     # tpot 0.1
        ok(ttft=0.3, latency=0.7, out=5, prompt=50, itl=[0.1] * 4),        # tpot 0.1
        ok(ttft=0.2, latency=0.2, out=1, prompt=30),                        # no tpot
        RequestResult(success=False, prompt_len=999, error="boom", latency=0.05),
    ]
    m = compute_metrics(results, duration=2.0, percentiles=[50])
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (180, 17)                 # failed ones not counted
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.5)
    assert m.total_token_throughput == pytest.approx((180 + 17) / 2)
    assert m.summaries["ttft"].mean == pytest.approx(200.0)
    assert m.summaries["ttft"].median == pytest.approx(200.0)
    assert m.summaries["tpot"].mean == pytest.approx(100.0)             # two values only
    assert m.summaries["itl"].mean == pytest.approx(100.0)
    assert m.summaries["e2el"].mean == pytest.approx(2000 / 3)
    assert m.request_goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    results = [ok(ttft=0.1, latency=1.1, out=11),      # ttft 100, tpot 100, e2el 1100
               ok(ttft=0.3, latency=0.7, out=5),       # ttft 300, tpot 100
               ok(ttft=0.05, latency=0.05, out=1),     # no tpot: passes a tpot SLO
               RequestResult(success=False)]
    slos = parse_goodput(["ttft:200", "tpot:100"])
    assert slos == {"ttft": 200.0, "tpot": 100.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, True, False]
    assert compute_metrics(results, 4.0, [99], slos).request_goodput == pytest.approx(0.5)
    assert compute_metrics(results, 4.0, [99], {"e2el": 1000}).request_goodput == pytest.approx(0.5)


@pytest.mark.parametrize("bad", ["ttft", "speed:3", "ttft:x", "tpot:0"])
def test_goodput_rejects_malformed_slos(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_peak_concurrency_and_timeline():
    results = [ok(0.1, 2.0, 4, start=0.0, chunks=[0.1, 0.5, 1.2, 1.9]),
               ok(0.1, 1.0, 2, start=0.5, chunks=[0.6, 1.4]),
               ok(0.1, 1.0, 4, start=2.0, chunks=[2.1, 2.9])]       # 2 chunks carry 4 tokens
    assert peak_concurrency(results) == 2  # the third starts as the first ends
    assert output_timeline(results, 3.0) == [3.0, 3.0, 4.0]
    m = compute_metrics(results, 3.0, [99])
    assert m.max_output_tokens_per_s == 4.0 and m.max_concurrent_requests == 2
