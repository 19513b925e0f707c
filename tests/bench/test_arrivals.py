"""Arrival process: Poisson by default, gamma-shaped by --burstiness, seeded."""
from __future__ import annotations

import math
import statistics
from itertools import pairwise

import pytest

from kvrelay.bench.arrivals import arrival_offsets


def _intervals(offsets: list[float]) -> list[float]:
    return [b - a for a, b in pairwise(offsets)]


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_poisson_intervals_have_mean_one_over_rate_and_cv_one():
    iv = _intervals(arrival_offsets(20001, rate=4.0, burstiness=1.0, seed=1))
    assert statistics.fmean(iv) == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(iv) / statistics.fmean(iv) == pytest.approx(1.0, rel=0.05)
    # exponential: P(interval > mean) = 1/e
    assert sum(x > 0.25 for x in iv) / len(iv) == pytest.approx(math.exp(-1), abs=0.015)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_rate_and_sets_cv(burstiness):
    iv = _intervals(arrival_offsets(20001, rate=10.0, burstiness=burstiness, seed=2))
    assert statistics.fmean(iv) == pytest.approx(0.1, rel=0.05)
    cv = statistics.pstdev(iv) / statistics.fmean(iv)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_seeded_and_starting_at_zero():
    a = arrival_offsets(50, 2.0, seed=7)
    assert a == arrival_offsets(50, 2.0, seed=7)
    assert a != arrival_offsets(50, 2.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in pairwise(a))


@pytest.mark.parametrize("rate,burst", [(0, 1), (-1, 1), (1, 0)])
def test_invalid_rate_or_burstiness(rate, burst):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burst)
