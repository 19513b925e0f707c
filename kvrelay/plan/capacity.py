"""Capacity planning for disaggregated serving: the fewest prefill (x) and decode (y) servers
that meet TTFT and ITL targets at an arrival rate, with the arithmetic spelled out.

Model (each step is printed by `Plan.explain`; checked by experiment in
benchmarks/plan_check.py, docs/deploy.md):

Queues. The proxy sends each request to the least-loaded prefill and decode server, so a
pool of c servers (or of c decode slots) behaves as one M/D/c queue: Poisson arrivals at λ,
near-constant service time s, offered load a = λ·s, utilisation ρ = a/c. Its mean wait is
taken as half the M/M/c one, W = C(c, a)·s / (2·(c - a)) (C: Erlang's C formula, the
chance an arrival waits) — exact for c = 1 (the M/D/1 wait ρ·s/(2(1-ρ))), the usual
approximation above. Treating the c servers as c separate M/D/1 queues at λ/c each (what
this planner did first) over-states the wait about 3x at c = 2, ρ = 0.6.

Prefill. A prompt of L tokens takes S = L / P seconds (P: one server's measured prefill
tokens/s), so x servers are an M/D/x queue with s = S.

Decode. A decode server measured at batch B produces D tokens/s, so one step (one token for
each of the B sequences) takes t(B) = B/D s: the ITL at batch B. With a second point (the
ITL at batch 1) the step time is interpolated linearly, t(b) = t1 + (t(B) - t1)·(b-1)/(B-1);
with one point it is taken as flat up to B (decode steps are memory-bound), and never
extrapolated past B. b_max is the largest batch with t(b) <= the ITL target: each decode
server's --max-num-seqs, so it has b_max slots. A sequence holds a slot for T = O·t
seconds (O output tokens), Little's law gives the slots busy, N = λ·T, and the y·b_max
slots are an M/D/(y·b_max) queue with s = T: a request that finds every slot taken waits,
its KV held on the prefill server, so y is the fewest with N / (y·b_max) <= `max_util`
(sizing to N / b_max alone ran the slots near 100 % busy: measured, TTFT went from 0.5 s
to 2.7 s, and prefill servers refused KV holds).

TTFT ≈ S + W_prefill + the KV hand-off (`handoff_ms`) + W_decode + one decode step; x is
the fewest prefill servers with ρ <= `max_util` and TTFT <= the target (y grows when the
decode wait alone leaves no room, or when a decode server more saves more than one
prefill server). Each prefill server's --max-num-seqs is
⌊max_num_batched_tokens / L⌋ (at least 1): more prompts at once than one step's token
budget only split it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PlanError(ValueError):
    """Inputs that cannot be planned (a one-line CLI message)."""


@dataclass(frozen=True)
class Measured:
    prefill_tok_s: float               # one prefill server, at the workload's prompt lengths
    decode_tok_s: float                # one decode server, output tokens/s at batch `decode_batch`
    decode_batch: int
    itl_at_1_ms: float | None = None   # optional second point of the decode step-time line


@dataclass(frozen=True)
class Workload:
    rate: float                        # requests/s (Poisson)
    prompt_len: float                  # mean prompt tokens
    output_len: float                  # mean output tokens
    ttft_ms: float
    itl_ms: float
    handoff_ms: float = 0.0            # KV transfer + proxy hop per request
    max_util: float = 0.8
    max_num_batched_tokens: int = 8192


@dataclass
class Plan:
    prefill: int
    decode: int
    prefill_max_num_seqs: int
    decode_max_num_seqs: int
    ttft_ms: float                     # predicted mean TTFT at `prefill`
    itl_ms: float                      # predicted ITL at the per-server batch
    lines: list[str] = field(default_factory=list)

    @property
    def topology(self) -> str:
        return f"{self.prefill}P{self.decode}D"

    def explain(self) -> str:
        return "\n".join(self.lines)


def step_ms(m: Measured, b: float) -> float:
    """Decode step time (= ITL) at batch b, in ms."""
    t_big = m.decode_batch / m.decode_tok_s * 1e3
    if m.itl_at_1_ms is None or m.decode_batch <= 1:
        return t_big
    return m.itl_at_1_ms + (t_big - m.itl_at_1_ms) * (b - 1) / (m.decode_batch - 1)


def erlang_c(c: int, a: float) -> float:
    """Erlang's C formula: the chance an arrival waits in an M/M/c queue at offered load
    a < c (from the Erlang B recursion, stable for large c)."""
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return c * b / (c - a * (1 - b))


def queue_wait_s(rate: float, service_s: float, servers: int) -> float:
    """Mean wait in an M/D/c queue (half the M/M/c wait; exact for c = 1)."""
    a = rate * service_s
    if a >= servers:
        return math.inf
    return erlang_c(servers, a) * service_s / (2 * (servers - a))


def prefill_ttft_ms(m: Measured, w: Workload, x: int, decode_wait_ms: float = 0.0
                    ) -> tuple[float, float]:
    """(utilisation ρ, predicted mean TTFT in ms) with x prefill servers."""
    s = w.prompt_len / m.prefill_tok_s
    rho = w.rate * s / x
    if rho >= 1:
        return rho, math.inf
    wait = queue_wait_s(w.rate, s, x)
    return rho, (s + wait) * 1e3 + w.handoff_ms + decode_wait_ms + step_ms(m, 1)


def decode_slot_s(m: Measured, w: Workload, b_max: int) -> float:
    """T: how long a sequence holds a decode slot."""
    return w.output_len * min(step_ms(m, b_max), w.itl_ms) / 1e3


def plan(m: Measured, w: Workload, max_servers: int = 1024) -> Plan:
    _check(m, w)
    lines: list[str] = []
    s = w.prompt_len / m.prefill_tok_s
    if s * 1e3 + w.handoff_ms + step_ms(m, 1) > w.ttft_ms:
        raise PlanError(f"a {w.prompt_len:g}-token prompt alone takes {s * 1e3:.0f} ms to "
                        f"prefill (+{w.handoff_ms:g} ms hand-off): no count of servers meets "
                        f"TTFT {w.ttft_ms:g} ms (a faster server, TP, or shorter prompts)")
    b_max = _b_max(m, w, lines)
    t_slot = decode_slot_s(m, w, b_max)
    n_seq = w.rate * t_slot
    y = max(1, math.ceil(n_seq / (w.max_util * b_max)))
    lines.append(f"decode: a sequence holds a slot T = O·t = {w.output_len:g} x "
                 f"{t_slot / w.output_len * 1e3:.1f} ms = {t_slot:.3f} s; N = λ·T = "
                 f"{w.rate:g} x {t_slot:.3f} = {n_seq:.2f} slots busy; y = ⌈N / (max_util·"
                 f"b_max)⌉ = ⌈{n_seq:.2f} / ({w.max_util:g} x {b_max})⌉ = {y}")
    lines.append(f"prefill: S = L / P = {w.prompt_len:g} / {m.prefill_tok_s:g} = "
                 f"{s * 1e3:.1f} ms per prompt; demand λ·S = {w.rate:g} x {s:.4f} = "
                 f"{w.rate * s:.3f} servers busy")
    # the fewest servers in all: a decode server more can save more than one prefill server
    # (its shorter wait), so up to two more counts are tried past the first that works
    # (k more only help when they can save k + 1 prefill servers)
    found: list[tuple[int, int, int, float]] = []          # (x + y, y, x, W_d)
    last = max_servers
    while y <= last:
        wd = queue_wait_s(w.rate, t_slot, y * b_max) * 1e3
        lines.append(f"  y={y}: decode wait W_d (M/D/{y * b_max}, ρ = "
                     f"{n_seq / (y * b_max):.3f}) = {wd:.0f} ms")
        x = _prefill_count(m, w, wd, max_servers, lines)
        if x:
            found.append((x + y, y, x, wd))
            last = min(last, y + min(2, x - 2))
        y += 1
    if not found:
        raise PlanError(f"more than {max_servers} decode servers needed")
    _, y, x, wd = min(found)
    lines.append(f"--max-num-seqs: decode b_max = {b_max} (about {n_seq / y:.1f} busy each); "
                 f"prefill ⌊{w.max_num_batched_tokens} / {w.prompt_len:g}⌋ = "
                 f"{(ps := max(1, w.max_num_batched_tokens // max(1, round(w.prompt_len))))}")
    _, ttft = prefill_ttft_ms(m, w, x, wd)
    itl = step_ms(m, max(1.0, min(b_max, n_seq / y)))
    lines.append(f"recommendation: {x}P{y}D — predicted TTFT {ttft:.0f} ms "
                 f"(target {w.ttft_ms:g}), ITL {itl:.1f} ms (target {w.itl_ms:g})")
    return Plan(x, y, ps, b_max, ttft, itl, lines)


def _prefill_count(m: Measured, w: Workload, decode_wait_ms: float, max_servers: int,
                   lines: list[str]) -> int:
    """The fewest prefill servers meeting the TTFT target given the decode wait, or 0 when
    none does (the decode wait alone leaves no room)."""
    s_ms = w.prompt_len / m.prefill_tok_s * 1e3
    for n in range(1, max_servers + 1):
        rho, ttft = prefill_ttft_ms(m, w, n, decode_wait_ms)
        ok = rho <= w.max_util and ttft <= w.ttft_ms
        lines.append(f"    x={n}: ρ = {rho:.3f}, W = C(x, λS)·S/(2(x-λS)), TTFT ≈ S + W + "
                     f"handoff {w.handoff_ms:g} + W_d {decode_wait_ms:.0f} + step "
                     f"{step_ms(m, 1):.1f} = {_ms(ttft)} {'meets' if ok else 'misses'} "
                     f"{w.ttft_ms:g} ms" + ("" if rho <= w.max_util else
                                            f" (ρ > {w.max_util:g})"))
        if ok:
            return n
        if rho <= w.max_util and s_ms + w.handoff_ms + decode_wait_ms + step_ms(m, 1) \
                > w.ttft_ms:
            return 0
    raise PlanError(f"more than {max_servers} prefill servers needed")


def _b_max(m: Measured, w: Workload, lines: list[str]) -> int:
    t_big = step_ms(m, m.decode_batch)
    if m.itl_at_1_ms is None:
        ok = t_big <= w.itl_ms
        lines.append(f"decode: step at batch {m.decode_batch} = B / D = {m.decode_batch} / "
                     f"{m.decode_tok_s:g} = {t_big:.1f} ms, taken as flat up to B: "
                     f"b_max = {m.decode_batch if ok else 0}")
        if not ok:
            raise PlanError(f"decode ITL {t_big:.1f} ms at batch {m.decode_batch} is over the "
                            f"{w.itl_ms:g} ms target: measure at a smaller batch (--decode-batch) "
                            f"or give --itl-at-1-ms")
        return m.decode_batch
    b = 0
    for n in range(1, m.decode_batch + 1):
        if step_ms(m, n) <= w.itl_ms:
            b = n
    lines.append(f"decode: step t(b) = {m.itl_at_1_ms:g} + ({t_big:.1f} - {m.itl_at_1_ms:g})"
                 f"·(b-1)/({m.decode_batch}-1) ms; largest b <= {m.decode_batch} with t(b) <= "
                 f"{w.itl_ms:g} ms: b_max = {b}")
    if b == 0:
        raise PlanError(f"decode ITL at batch 1 ({m.itl_at_1_ms:g} ms) is over the "
                        f"{w.itl_ms:g} ms target")
    return b


def neighbours(m: Measured, w: Workload, p: Plan) -> list[str]:
    """Why one server fewer on either side misses a target (the plan is minimal)."""
    out = []
    t_slot = decode_slot_s(m, w, p.decode_max_num_seqs)
    wd = queue_wait_s(w.rate, t_slot, p.decode * p.decode_max_num_seqs) * 1e3
    if p.prefill > 1:
        rho, ttft = prefill_ttft_ms(m, w, p.prefill - 1, wd)
        out.append(f"{p.prefill - 1}P{p.decode}D: prefill ρ = {rho:.2f}, TTFT ≈ {_ms(ttft)} "
                   f"(target {w.ttft_ms:g})")
    if p.decode > 1:
        slots = (p.decode - 1) * p.decode_max_num_seqs
        rho = w.rate * t_slot / slots
        wd1 = queue_wait_s(w.rate, t_slot, slots) * 1e3
        _, ttft = prefill_ttft_ms(m, w, p.prefill, wd1)
        out.append(f"{p.prefill}P{p.decode - 1}D: decode slots ρ = {rho:.2f} "
                   f"(max {w.max_util:g}), TTFT ≈ {_ms(ttft)} (target {w.ttft_ms:g})")
    return out


def _ms(v: float) -> str:
    return "unbounded (ρ >= 1)" if math.isinf(v) else f"{v:.0f} ms"


def _check(m: Measured, w: Workload) -> None:
    for name, v in (("prefill tokens/s", m.prefill_tok_s), ("decode tokens/s", m.decode_tok_s),
                    ("decode batch", m.decode_batch), ("rate", w.rate),
                    ("prompt length", w.prompt_len), ("output length", w.output_len),
                    ("TTFT target", w.ttft_ms), ("ITL target", w.itl_ms)):
        if not v > 0:
            raise PlanError(f"{name} must be positive (got {v:g})")
    if not 0 < w.max_util < 1:
        raise PlanError(f"--max-util must be in (0, 1) (got {w.max_util:g})")


# ---------------------------------------------------------------- bench result files

def _load(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"{path}: cannot read a bench result: {e}") from e
    if not isinstance(data, dict) or not data.get("completed"):
        raise PlanError(f"{path}: not a `kvrelay bench serve --save-result` file with completed "
                        f"requests")
    return data


def prefill_from_result(path: str) -> float:
    """Prefill tokens/s of one server: Σ prompt tokens / Σ TTFT of a run at concurrency 1
    against it (each TTFT is then one prompt's prefill alone)."""
    d = _load(path)
    pairs = [(n, t) for n, t in zip(d.get("input_lens", []), d.get("ttfts", [])) if t and t > 0]
    if not pairs:
        raise PlanError(f"{path}: no per-request input_lens/ttfts")
    return sum(n for n, _ in pairs) / sum(t for _, t in pairs)


def decode_from_result(path: str) -> tuple[float, int, float]:
    """(output tokens/s at batch B, B, mean ITL ms) of a run at --max-concurrency B. The
    tokens/s is B / the mean ITL when the file has ITLs: the run's output_throughput also
    counts the time each request waits for its first token — behind a proxy, mostly its
    prefill — so it under-states what the decode server does at batch B."""
    d = _load(path)
    batch = d.get("max_concurrency") or d.get("max_concurrent_requests")
    itl = d.get("mean_itl_ms") or d.get("median_itl_ms")
    if not batch or not (itl or d.get("output_throughput")):
        raise PlanError(f"{path}: no max_concurrency / ITL or output_throughput")
    tok_s = int(batch) / float(itl) * 1e3 if itl else float(d["output_throughput"])
    return tok_s, int(batch), float(itl or 0)


def workload_from_result(path: str) -> tuple[float, float, float]:
    """(request rate, mean prompt tokens, mean output tokens) of a recorded run."""
    d = _load(path)
    ins, outs = d.get("input_lens") or [], d.get("output_lens") or []
    rate = d.get("request_rate")
    if not isinstance(rate, int | float) or math.isinf(rate):
        rate = d.get("request_throughput") or 0.0
    if not ins or not outs:
        raise PlanError(f"{path}: no per-request input_lens/output_lens")
    return float(rate), sum(ins) / len(ins), sum(outs) / len(outs)
