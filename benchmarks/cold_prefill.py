#!/usr/bin/env python
"""Cold prefill (TTFT without a prefix-cache hit), broken down by module.

    python benchmarks/cold_prefill.py [--model embedded|tiny|PATH] [--prompt-len 200]
        [--reps 8] [--jitter 0] [--cpu-time] [--out FILE.json]

`LLMEngine` in this process runs `--reps` one-token greedy requests, each a fresh random
prompt (no prefix-cache hit, unlike step_profile.py's warm "prefill" figure), and times
the prefill step's spans with step_profile.py's instrumentation (`--parts`: embedding,
norms, qkv, rotary, attention, o_proj, router, experts, LM head; runner preparation,
sampler, outputs). Reported: the very first prefill of the process (what the first served
request pays: page faults, allocator growth, oneDNN primitive creation) and the median of
the others.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_profile
from common import CONFIGS, ROOT, build_checkpoint, write_result


def cold_prefills(model: str, prompt_len: int, reps: int, engine_args: dict[str, Any],
                  jitter: int = 0, seed: int = 0) -> dict[str, Any]:
    import torch

    from kvrelay.config import EngineArgs
    from kvrelay.engine.core import LLMEngine
    from kvrelay.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    engine = LLMEngine(EngineArgs(model=model, dtype="bfloat16", **engine_args))
    step_profile.instrument(engine)
    step_profile.instrument_parts(engine.runner.model)
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, int]] = []
    for rep in range(reps):
        length = prompt_len + rng.randint(-jitter, jitter)
        prompt = [rng.randrange(100, vocab) for _ in range(length)]
        engine.add_request(f"cold{rep}", prompt, params)
        step_profile.SPANS.clear()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        while engine.has_unfinished_requests():
            engine.step()
        step_profile.SPANS["minor faults (x1e6)"] = (
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        runs.append(dict(step_profile.SPANS))

    def ms(span: dict[str, int]) -> dict[str, float]:
        return {k: round(v / 1e6, 3) for k, v in span.items()}

    names = list(dict.fromkeys(n for r in runs for n in r))
    rest = runs[1:] or runs
    return {
        "first": ms(runs[0]),
        "median": {n: round(statistics.median(r.get(n, 0) for r in rest) / 1e6, 3)
                   for n in names},
        "reps": reps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--jitter", type=int, default=0,
                    help="prompt lengths drawn from prompt-len +- jitter (a new shape each time)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="spans in CPU time of the (single) compute thread")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--max-model-len", type=int, default=4096, help="as benchmarks/peers.py")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    a = ap.parse_args()
    engine_args = {"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs}
    if a.cpu_time:
        step_profile.CLOCK = time.thread_time_ns
        os.environ["BENCH_THREADS"] = "1"
    if a.model == "embedded":
        from kvrelay.model.embedded import embedded_model_dir
        model = str(embedded_model_dir())
    elif a.model == "tiny":
        model = str(build_checkpoint("tiny", CONFIGS["tiny"]))
    else:
        model = a.model
    result = {"model": model, "load": os.getloadavg(),
              "clock": "thread CPU time" if a.cpu_time else "wall",
              "prefill_ms": cold_prefills(
        model, a.prompt_len, a.reps, engine_args, a.jitter)}
    write_result(result, a.out)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
