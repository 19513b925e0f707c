#!/usr/bin/env python
"""Speculative decoding (n-gram drafts): c=1 decode tok/s with `--speculative-config` on
and off, on a workload that copies spans of its prompt and on one with no repetition.

Run by hand (not a pytest test), from the kvrelay venv:

    python benchmarks/spec_decode.py [--quick] [--rounds 5] [--out FILE]
        [--spec '{"method": "ngram", "num_speculative_tokens": 3, ...}'] [--draft-self]

--draft-self: the draft-model method with the benchmark's own checkpoint as its draft (K
from --spec, default 3): every draft is accepted, so it shows what a perfect draft of the
target's own cost gains — an upper bound on acceptance, a worst case on draft cost.

The model is the tiny bf16 checkpoint of benchmarks/common.py (random gpt-oss, vocab
2048, 4 layers). Two engines (`LLM`, one with the speculative config, one without) live
in this process; each round runs every request once on each, one request at a time
(concurrency 1), back to back, the order alternating by request, so the machine's drift
hits both alike. A request's decode time runs from the step that produced its first token
to its last step; decode tok/s = (output tokens - 1) / decode time, summed over the
round's requests, in wall time and in this process's CPU time (on a machine shared with
other jobs the CPU-time rate is the steadier one: time spent waiting for a core is not
counted). The reported ratios are the medians over rounds of (spec on / spec off).

Workloads (prompts of random token ids, seeded; ignore_eos):
  copy     greedy. The prompt is a random 200-token prefix S followed by the first 384
           tokens the model itself generates after S (computed once, spec off); the
           request then generates 256 more. This random model's greedy text keeps
           returning to a few short phrases, so the answer copies spans that the
           prompt already holds (what editing or quoting a given text looks like).
  norepeat temperature 1, seeded: the random model's sampled text hardly repeats, so few
           n-gram matches are found and the engine mostly runs plain decodes (it backs
           off by itself); the ratio measures what the lookups and the rejected drafts cost.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    CONFIGS,
    QUICK_CONFIGS,
    THREADS,
    build_checkpoint,
    log,
    machine_info,
    wait_for_quiet,
    write_result,
)

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}


def decode_time(llm: Any, prompt: list[int], params: Any) -> tuple[int, float, float]:
    """(decode tokens, wall seconds, CPU seconds) of one request run alone."""
    engine = llm.engine
    request_id = f"r{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    t0 = c0 = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if t0 is None and out.outputs[0].token_ids:
                t0, c0 = time.perf_counter(), time.process_time()
            tokens = len(out.outputs[0].token_ids)
    assert t0 is not None and c0 is not None
    return tokens - 1, time.perf_counter() - t0, time.process_time() - c0


def workloads(llm: Any, num: int, quick: bool) -> dict[str, tuple[list[list[int]], list[Any]]]:
    from kvrelay import SamplingParams
    rng = random.Random(0)
    vocab = CONFIGS["tiny"]["vocab_size"]
    out_len = 64 if quick else 256
    seeds = [[rng.randrange(1, vocab) for _ in range(200)] for _ in range(num)]
    grow = SamplingParams(temperature=0, max_tokens=96 if quick else 384, ignore_eos=True)
    own = [o.outputs[0].token_ids for o in llm.generate(seeds, grow)]
    copy = [s + list(g) for s, g in zip(seeds, own)]
    greedy = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=out_len, ignore_eos=True)
               for i in range(num)]
    return {"copy": (copy, [greedy] * num), "norepeat": (seeds, sampled)}


def spec_counters(llm: Any) -> dict[str, Any]:
    s = llm.engine.spec_stats
    return {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
            "accepted": s.num_accepted_tokens, "accepted_per_pos": list(s.accepted_per_pos)}


def run_round(engines: dict[str, Any], prompts: list[list[int]],
              params: list[Any]) -> dict[str, dict[str, float]]:
    """{engine: {"wall": tok/s, "cpu": tok/s}} over the requests, each run on every engine
    back to back (the engines' order alternating by request)."""
    names = list(engines)
    sums = {name: [0.0, 0.0, 0.0] for name in names}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        for name in names if i % 2 == 0 else names[::-1]:
            for j, value in enumerate(decode_time(engines[name], prompt, p)):
                sums[name][j] += value
    return {name: {"wall": n / wall, "cpu": n / cpu} for name, (n, wall, cpu) in sums.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, short outputs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=4, help="requests per workload and round")
    ap.add_argument("--spec", type=json.loads, default=DEFAULT_SPEC,
                    help=f"the speculative config (default: {json.dumps(DEFAULT_SPEC)})")
    ap.add_argument("--draft-self", action="store_true",
                    help="draft model = the benchmark's checkpoint itself (K from --spec)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--wait", type=float, default=300,
                    help="seconds to wait at most for other processes to quieten first")
    args = ap.parse_args()
    import torch

    from kvrelay import LLM
    torch.set_num_threads(THREADS)
    cfg = (QUICK_CONFIGS if args.quick else CONFIGS)["tiny"]
    path = build_checkpoint("tiny", cfg)
    common = dict(dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False)
    spec = ({"model": str(path), "num_speculative_tokens": args.spec["num_speculative_tokens"]}
            if args.draft_self else args.spec)
    engines = {"off": LLM(str(path), **common),
               "on": LLM(str(path), speculative_config=spec, **common)}
    loads = workloads(engines["off"], args.requests, args.quick)
    result: dict[str, Any] = {"benchmark": "spec_decode", "machine": machine_info(),
                              "model": f"tiny bf16 ({path.name})", "spec": spec,
                              "rounds": args.rounds, "requests": args.requests,
                              "quiet": wait_for_quiet(args.wait)}
    for name, (prompts, params) in loads.items():
        run_round(engines, prompts[:1], params[:1])       # warm-up: every shape once
        before = spec_counters(engines["on"])
        rounds = []
        for r in range(args.rounds):
            rates = run_round(engines, prompts, params)
            rounds.append(rates)
            log(f"{name} round {r}: " + ", ".join(
                f"{e} {x['wall']:.0f} tok/s ({x['cpu']:.0f} per CPU s)" for e, x in rates.items()))
        after = spec_counters(engines["on"])
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted"] - before["accepted"]
        result[name] = {"drafts": after["drafts"] - before["drafts"], "draft_tokens": drafted,
                        "accepted": accepted,
                        "acceptance_rate": accepted / drafted if drafted else None}
        for clock in ("wall", "cpu"):
            ratios = [x["on"][clock] / x["off"][clock] for x in rounds]
            result[name] |= {
                f"off_tok_s_{clock}_median": statistics.median(x["off"][clock] for x in rounds),
                f"on_tok_s_{clock}_median": statistics.median(x["on"][clock] for x in rounds),
                f"ratio_{clock}_median": statistics.median(ratios), f"ratios_{clock}": ratios}
    for llm in engines.values():
        llm.shutdown()
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
