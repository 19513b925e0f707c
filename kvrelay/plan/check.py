"""Checking a plan by experiment (benchmarks/plan_check.py): which topologies to deploy next
to the recommendation, the workload that makes a small xPyD the answer, and whether the
measured runs bear the plan out.

Targets are read the way the planner predicts them: mean TTFT and mean ITL of a run (the
queueing model gives means), with p50/p99 shown beside them. A run meets the targets only
when every request completed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from kvrelay.plan.capacity import (
    Measured,
    Workload,
    decode_slot_s,
    prefill_ttft_ms,
    queue_wait_s,
    step_ms,
)


@dataclass(frozen=True)
class Targets:
    rate: float             # requests/s
    prompt_len: int
    output_len: int
    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class Run:
    prefill: int
    decode: int
    requests: int           # sent
    completed: int
    mean_ttft_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    mean_itl_ms: float
    p50_itl_ms: float
    p99_itl_ms: float
    output_tok_s: float
    request_s: float
    arrival_s: float = math.nan   # the rate requests were actually sent at (Poisson sample)

    @property
    def topology(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    @property
    def servers(self) -> int:
        return self.prefill + self.decode

    def meets(self, t: Targets) -> bool:
        return (self.completed == self.requests and self.mean_ttft_ms <= t.ttft_ms
                and self.mean_itl_ms <= t.itl_ms)


def run_from_result(prefill: int, decode: int, requests: int, d: dict[str, Any]) -> Run:
    """A `kvrelay bench serve --save-result` dict (with --percentile-metrics ttft,itl and
    --metric-percentiles 50,99) as a Run."""
    def get(key: str) -> float:
        v = d.get(key)
        return float(v) if isinstance(v, int | float) else math.nan
    starts = [t for t in d.get("start_times") or [] if isinstance(t, int | float)]
    sent = ((len(starts) - 1) / (max(starts) - min(starts)) if len(starts) > 1
            and max(starts) > min(starts) else math.nan)
    return Run(prefill, decode, requests, int(d.get("completed") or 0),
               get("mean_ttft_ms"), get("median_ttft_ms"), get("p99_ttft_ms"),
               get("mean_itl_ms"), get("median_itl_ms"), get("p99_itl_ms"),
               get("output_throughput"), get("request_throughput"), sent)


def neighbour_topologies(prefill: int, decode: int, max_servers: int) -> list[tuple[int, int]]:
    """The recommendation first, then one server fewer or more on each side, those with
    at most `max_servers` servers (what the machine can hold)."""
    cands = [(prefill, decode), (prefill - 1, decode), (prefill + 1, decode),
             (prefill, decode - 1), (prefill, decode + 1)]
    return [(x, y) for x, y in cands if x >= 1 and y >= 1 and x + y <= max_servers]


def choose_targets(m: Measured, handoff_ms: float, prompt_len: int, output_len: int,
                   demand: float, ttft_factor: float, itl_factor: float) -> Targets:
    """A workload whose answer is a small xPyD: the arrival rate keeps `demand` prefill
    servers busy (rate = demand · P / L; demand 1.2 → one server is overloaded, two run at
    ρ = 0.6), the TTFT target is `ttft_factor` × a lone request's TTFT (prefill + hand-off
    + one decode step) and the ITL target `itl_factor` × the step time at batch 1."""
    s_ms = prompt_len / m.prefill_tok_s * 1e3
    lone = s_ms + handoff_ms + step_ms(m, 1)
    return Targets(demand * m.prefill_tok_s / prompt_len, prompt_len, output_len,
                   ttft_factor * lone, itl_factor * step_ms(m, 1))


def planned_ttft_ms(m: Measured, w: Workload, x: int, y: int, b_max: int) -> float:
    """The planner's mean TTFT for xPyD with b_max slots per decode server (its decode
    wait included)."""
    wd = queue_wait_s(w.rate, decode_slot_s(m, w, b_max), y * b_max) * 1e3
    return prefill_ttft_ms(m, w, x, wd)[1]


def verdict(runs: list[Run], targets: Targets, recommended: tuple[int, int]) -> str:
    """One line: does the recommendation meet the targets, and is it the smallest that did."""
    rec = next((r for r in runs if (r.prefill, r.decode) == recommended), None)
    if rec is None:
        return "the recommendation was not run"
    met = [r for r in runs if r.meets(targets)]
    smaller = [r.topology for r in met if r.servers < rec.servers]
    if not rec.meets(targets):
        return (f"{rec.topology} (recommended) MISSES the targets"
                + (f"; {', '.join(smaller)} met them with fewer servers" if smaller else ""))
    if smaller:
        return (f"{rec.topology} (recommended) meets the targets, but {', '.join(smaller)} "
                f"met them with fewer servers: the plan over-provisions")
    fewer = [r for r in runs if r.servers < rec.servers]
    if not fewer:
        return (f"{rec.topology} (recommended) meets the targets; no smaller topology "
                f"was run")
    return (f"{rec.topology} (recommended) meets the targets with the fewest servers: "
            f"{', '.join(r.topology for r in fewer)} {'misses' if len(fewer) == 1 else 'miss'}"
            f" them")


def table(runs: list[Run], targets: Targets, recommended: tuple[int, int],
          predicted_ttft_ms: dict[tuple[int, int], float] | None = None) -> str:
    """Markdown: one row per run, the recommendation marked; with `predicted_ttft_ms`
    (topology → the planner's mean TTFT), a column comparing it with the measured mean."""
    pred = predicted_ttft_ms or {}
    head = ("| topology | servers | TTFT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) "
            "| output tok/s | req/s served (sent) | completed | targets |")
    if pred:
        head += " planned mean TTFT (ms) |"
    rows = [head, "|" + "---|" * (9 if pred else 8)]
    for r in runs:
        mark = " (recommended)" if (r.prefill, r.decode) == recommended else ""
        row = (f"| {r.topology}{mark} | {r.servers} | {r.mean_ttft_ms:.0f} / "
               f"{r.p50_ttft_ms:.0f} / {r.p99_ttft_ms:.0f} | {r.mean_itl_ms:.1f} / "
               f"{r.p50_itl_ms:.1f} / {r.p99_itl_ms:.1f} | {r.output_tok_s:.1f} | "
               f"{r.request_s:.2f} ({r.arrival_s:.2f}) | {r.completed}/{r.requests} | "
               f"{'met' if r.meets(targets) else 'missed'} |")
        if pred:
            p = pred.get((r.prefill, r.decode), math.nan)
            row += " unbounded |" if math.isinf(p) else f" {p:.0f} |"
        rows.append(row)
    return "\n".join(rows)

def parse_recommendation(text: str) -> tuple[int, int, int, int]:
    """(x, y, prefill --max-num-seqs, decode --max-num-seqs) from `kvrelay plan`'s output."""
    rec = re.search(r"recommendation: (\d+)P(\d+)D", text)
    seqs = re.search(r"decode b_max = (\d+).*?prefill .*?= (\d+)", text)
    if not rec or not seqs:
        raise ValueError(f"not kvrelay plan's output:\n{text}")
    return int(rec[1]), int(rec[2]), int(seqs[2]), int(seqs[1])
