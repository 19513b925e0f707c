#!/usr/bin/env python
"""MXFP4 experts against bf16 experts of the same tiny model, in one process, alternated.

    python benchmarks/format_ab.py [--rounds 16] [--concurrency 1,64] [--prompt-len 200]
        [--output-len 64] [--out FILE.json]

The checkpoints are `benchmarks/peers.py`'s tiny pair (o200k vocabulary, the same weights,
experts in bf16 and in the official MXFP4 layout). Both load as offline engines
(`kvrelay.LLM`) in this process; for each concurrency N every round runs one
`LLM.generate` of N requests (greedy, ignore_eos) on each, the order alternating by round,
and takes MXFP4 tok/s ÷ bf16 tok/s of that round. On a shared machine whose speed drifts
over minutes, a ratio of two servers measured a minute apart (`peers.py`) carries that
drift; calls a fraction of a second apart do not, so this is the A/B for the issue 12
target "tiny MXFP4 ≥ its own bf16" (the HTTP and API-process work a served token adds is
the same for both formats).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import THREADS, log, machine_info, write_result
from peers import tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(THREADS)
    from kvrelay import LLM, SamplingParams

    llms = {}
    for fmt in ("bf16", "mxfp4"):
        log(f"loading the tiny {fmt} checkpoint")
        llms[fmt] = LLM(str(tiny_checkpoint(fmt == "mxfp4")), dtype="bfloat16", max_num_seqs=64,
                        max_model_len=args.prompt_len + args.output_len + 16,
                        enable_prefix_caching=False, seed=0)
    rng = random.Random(0)
    result: dict = {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)},
                    "concurrency": {}}
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [[rng.randrange(5, 2000) for _ in range(args.prompt_len)] for _ in range(c)]
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * c
        for llm in llms.values():                           # warm: first-call set-up
            llm.generate(prompts, params)
        tok_s: dict[str, list[float]] = {fmt: [] for fmt in llms}
        for r in range(args.rounds):
            for fmt in (("bf16", "mxfp4") if r % 2 == 0 else ("mxfp4", "bf16")):
                t0 = time.perf_counter()
                llms[fmt].generate(prompts, params)
                tok_s[fmt].append(c * args.output_len / (time.perf_counter() - t0))
        ratios = [m / b for b, m in zip(tok_s["bf16"], tok_s["mxfp4"])]
        cell = {"tok_s": tok_s, "ratios": ratios, "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios), "ratio_max": max(ratios)}
        result["concurrency"][c] = cell
        log(f"c={c}: bf16 {statistics.median(tok_s['bf16']):.0f} tok/s, MXFP4 "
            f"{statistics.median(tok_s['mxfp4']):.0f}; MXFP4 / bf16 per round: median "
            f"{cell['ratio_median']:.3f} [{cell['ratio_min']:.3f}-{cell['ratio_max']:.3f}]")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
