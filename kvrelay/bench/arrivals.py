"""When each request (or conversation) is sent: vLLM's arrival process.

Intervals between arrivals are drawn from a gamma distribution with shape `burstiness`
and scale 1 / (rate · burstiness), so the mean interval is 1 / rate whatever the shape:

    burstiness = 1   exponential intervals — a Poisson process
    burstiness < 1   burstier (coefficient of variation 1/sqrt(burstiness) > 1)
    burstiness > 1   more regular (→ a constant interval as burstiness → ∞)

rate = inf sends everything at time 0 (then only --max-concurrency paces the run).
"""
from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of n arrivals; the first is at 0."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf); got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0; got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets
