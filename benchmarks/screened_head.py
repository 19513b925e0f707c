"""The greedy LM head: exact vs screened (layers/screened.py), per call, same process.

    python benchmarks/screened_head.py [--hidden 32,2880] [--rows 1,8] [--threads 1,2]
        [--vocab 201088] [--seconds 2] [--out FILE.json]

For each hidden size, a bf16 LM head of `--vocab` rows with random weights (N(0, 0.02²):
the benchmark's tiny model's initialisation; gpt-oss-20b's shape at 2,880) and random
inputs (N(0, 1), bf16; a new one each call from a pool of 32). Two heads share the weight:
one under this process's plan with the screen off (the exact path: `ParallelLMHead.greedy`
where a native kernel gives the ids, else `logits` + argmax_rows, as the engine does) and
one with it on. Calls alternate between them so machine noise hits both alike; each cell
runs `--seconds` per head (at least 3 calls). The first call of each key (the screen's
check against the exact path) is timed apart and not counted.

Reported per cell: median and 10th-percentile µs per call, each side, and the candidates
(vocabulary rows computed exactly) per input row the screen saw. Random weights are a hard
case for the screen: a trained head's winning logit usually stands further above the rest
than the top of 201k random dot products does, and the bound does not care which. The
header prints the CPU, torch's version and the load average (compare within one run).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "20000")     # as `kvrelay serve` does (cli.py)

import torch  # after the OpenMP setting: libgomp reads it when loaded

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_model  # noqa: E402 -- after the sys.path insert

from kvrelay.model import execution_plan, kernels  # noqa: E402
from kvrelay.model.layers.embedding import ParallelLMHead  # noqa: E402
from kvrelay.model.parallel import ParallelContext  # noqa: E402


def heads(vocab: int, hidden: int) -> tuple[ParallelLMHead, ParallelLMHead]:
    """(exact, screened): one bf16 weight, two plans."""
    plan = execution_plan.current()
    if not plan.screened_head:
        raise SystemExit(f"this process's plan does not screen the head: {plan.describe()}")
    exact = ParallelLMHead(vocab, hidden, ParallelContext(), torch.bfloat16,
                           dataclasses.replace(plan, screened_head=False))
    g = torch.Generator().manual_seed(hidden)
    with torch.no_grad():
        for start in range(0, vocab, 16384):
            rows = exact.weight[start:start + 16384]
            rows.copy_(torch.randn(rows.shape, generator=g) * 0.02)
    screened = ParallelLMHead(vocab, hidden, ParallelContext(), torch.bfloat16, plan)
    screened.weight = exact.weight
    return exact, screened


def greedy(head: ParallelLMHead) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine's greedy step: the head's ids, else the logits' argmax."""
    def call(x: torch.Tensor) -> torch.Tensor:
        ids = head.greedy(x)
        return ids if ids is not None else torch.ops.kvrelay_kernels.argmax_rows(
            head.logits(x), "")
    return call


def cell(exact: ParallelLMHead, screened: ParallelLMHead, rows: int,
         seconds: float) -> dict[str, object]:
    g = torch.Generator().manual_seed(rows)
    pool = [torch.randn(rows, exact.weight.shape[1], generator=g).bfloat16() for _ in range(32)]
    calls = {"exact": greedy(exact), "screened": greedy(screened)}
    first: dict[str, float] = {}
    for name, f in calls.items():                     # the first call of the key: the check
        t0 = time.perf_counter()
        f(pool[0])
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in calls}
    i = 0
    while min(sum(t) for t in times.values()) < seconds or min(map(len, times.values())) < 3:
        x = pool[i % len(pool)]
        i += 1
        answers = []
        for name, f in calls.items():
            t0 = time.perf_counter()
            answers.append(f(x))
            times[name].append(time.perf_counter() - t0)
        if not torch.equal(answers[0], answers[1]):
            raise SystemExit(f"different tokens: exact {answers[0].tolist()}, screened "
                             f"{answers[1].tolist()}")
    stats = screened.screen.stats if screened.screen else None
    seen = list(stats.candidates)[-len(times["screened"]) * rows:] if stats else []
    out: dict[str, object] = {"rows": rows, "calls": len(times["exact"]),
                              "first_call_s": first,
                              "fallbacks": stats.fallbacks if stats else None,
                              "candidates": {"median": statistics.median(seen) if seen else None,
                                             "max": max(seen) if seen else None}}
    for name, t in times.items():
        t.sort()
        out[name] = {"median_us": 1e6 * statistics.median(t), "p10_us": 1e6 * t[len(t) // 10]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", default="32,2880")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    status = kernels.status()
    if not status.available:
        raise SystemExit(f"the native kernels are not available: {status.reason}")
    print(f"# {cpu_model()}; torch {torch.__version__}; {platform.python_version()}; "
          f"load {os.getloadavg()}; {execution_plan.current().describe()}", flush=True)
    results = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        exact, screened = heads(args.vocab, hidden)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                r = cell(exact, screened, rows, args.seconds) | {"hidden": hidden,
                                                                 "threads": threads}
                results.append(r)
                e, s = r["exact"], r["screened"]
                assert isinstance(e, dict) and isinstance(s, dict)
                print(f"H={hidden:5d} threads={threads} rows={rows:2d}: exact "
                      f"{e['median_us']:9.0f} µs (p10 {e['p10_us']:9.0f}), screened "
                      f"{s['median_us']:9.0f} µs (p10 {s['p10_us']:9.0f}), "
                      f"x{e['median_us'] / s['median_us']:.2f}; candidates/row "
                      f"{r['candidates']}; calls {r['calls']}, fallbacks {r['fallbacks']}",
                      flush=True)
        del exact, screened
    print(f"# load after: {os.getloadavg()}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
