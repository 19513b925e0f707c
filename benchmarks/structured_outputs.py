"""Decode throughput with every request under a JSON schema vs none, in the same run.

The offline engine (no HTTP) runs C concurrent requests of the same prompt length; each
variant is timed from the step after every request has its first token to the end, so
the number is decode tokens per second. Two clocks: wall time, and the CPU time of this
process (every thread: torch's, the mask worker's). On a shared machine the wall clock
mostly measures the neighbours; CPU seconds are what the grammar adds, so the cost is
quoted from them (tokens per CPU-second). Variants alternate run by run; medians and their
ratio are reported:

    none       max_tokens M, ignore_eos (no grammar anywhere in the batch)
    json       every request under SCHEMA (an array of objects that cannot close within M
               tokens, so each request also decodes M tokens, masks changing every step)
    json-sync  json with the masks filled after the forward instead of during it
    json-thread  json with the masks always filled in the worker thread (json itself fills
               inline below OVERLAP_MIN_ROWS grammar rows, in the thread from there on)
    json-torch json as it was before the native row kernel: the grammar rows on the
               PyTorch reference path, and no speculative argmax check for greedy rows
    json-nospec json without the speculative check (every greedy grammar row gets its
               mask; the native kernel takes the masked argmax)

Models: `embedded` (the SmolLM2-as-gpt-oss checkpoint, 49k vocabulary) and `o200k-tiny`
(a 2-layer random gpt-oss with gpt-oss's 201k vocabulary: the forward is tiny, so the
grammar's share is the worst case). Usage:

    PYTHONPATH=. python benchmarks/structured_outputs.py [--model embedded|o200k-tiny]
        [--concurrency 8 64] [--max-tokens 32] [--reps 3] [--temperature 1.0] [--json out.json]
        [--variants none json json-torch]

Variants run in a rotated order each rep (none json sync, json sync none, ...).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CACHE, THREADS, loadavg, log, machine_info
from kvrelay.structured.masks import OVERLAP_MIN_ROWS

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150},
                       "ok": {"type": "boolean"}}}
SCHEMA = {"type": "array", "minItems": 100, "items": ITEM}
TEMPERATURE = 1.0
VARIANTS = ["none", "json", "json-sync", "json-thread", "json-torch", "json-nospec"]
PROMPT = "Return a JSON list of people with name, age and ok fields:"


def o200k_tiny() -> Path:
    """A 2-layer random gpt-oss with the o200k tokenizer (cached)."""
    path = CACHE / "structured-o200k-tiny"
    if (path / "tokenizer.json").is_file():
        return path
    from tests.factories import make_hf_model, save_checkpoint
    from tests.harmony_factories import GPT_OSS_VOCAB_SIZE, make_o200k_tokenizer_json
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_checkpoint(make_hf_model(seed=1, vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=64,
                                  head_dim=16, intermediate_size=64, num_local_experts=4), tmp)
    make_o200k_tokenizer_json(tmp)
    tmp.rename(path)
    return path


def run_once(llm, variant: str, concurrency: int, max_tokens: int) -> tuple[float, float]:
    """(decode tokens per wall second, per CPU second) of one batch of `concurrency`."""
    from kvrelay import SamplingParams
    from kvrelay.structured.params import StructuredOutputsParams
    engine = llm.engine
    engine.sampler.masks.overlap = variant != "json-sync"
    engine.sampler.masks.min_rows = 1 if variant == "json-thread" else OVERLAP_MIN_ROWS
    engine.sampler.masks.native = False if variant == "json-torch" else None
    engine.sampler.masks.speculate = variant not in ("json-torch", "json-nospec")
    constraint = None if variant == "none" else StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=constraint)
    ids = [f"{variant}-{time.monotonic_ns()}-{i}" for i in range(concurrency)]
    for rid in ids:
        engine.add_request(rid, PROMPT, params)
    produced: dict[str, int] = {}
    while len(produced) < concurrency or min(produced.values()) == 0:    # prefill + first token
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    start_tokens, t0, c0 = sum(produced.values()), time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    total = sum(produced.values())
    assert total == concurrency * max_tokens, (variant, total)
    return (total - start_tokens) / seconds, (total - start_tokens) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["embedded", "o200k-tiny"], default="embedded")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                    help="none and json always run")
    args = ap.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    import torch

    from kvrelay import LLM
    torch.set_num_threads(THREADS)
    model = None if args.model == "embedded" else str(o200k_tiny())
    llm = LLM(model, max_model_len=512, max_num_seqs=max(args.concurrency),
              dtype="float32" if model else "auto")
    variants = ["none", "json"] + [v for v in args.variants if v not in ("none", "json")]
    run_once(llm, "json", 2, 4)                       # compile the grammar, warm the paths
    results = {}
    for c in args.concurrency:
        runs: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for rep in range(args.reps):
            shift = rep % len(variants)
            for v in variants[shift:] + variants[:shift]:      # rotate: no order effect
                runs[v].append(run_once(llm, v, c, args.max_tokens))
                log(f"c={c} rep {rep} {v}: {runs[v][-1][0]:.1f} tok/s wall, "
                    f"{runs[v][-1][1]:.1f} tok/cpu-s (load {loadavg():.1f})")
        wall = {v: statistics.median(x[0] for x in r) for v, r in runs.items()}
        cpu = {v: statistics.median(x[1] for x in r) for v, r in runs.items()}
        results[c] = {"median_tok_s": wall, "median_tok_per_cpu_s": cpu, "runs": runs,
                      "cost_pct_cpu": {v: 100 * (1 - cpu[v] / cpu["none"]) for v in variants},
                      "cost_pct_wall": {v: 100 * (1 - wall[v] / wall["none"]) for v in variants}}
    info = {"model": args.model, "temperature": args.temperature, "max_tokens": args.max_tokens,
            "reps": args.reps, "threads": THREADS, "machine": machine_info(), "results": results}
    print(f"model {args.model}, temperature {args.temperature}, decode tokens per wall s | per "
          f"CPU s (medians of {args.reps}), max_tokens {args.max_tokens}; cost = throughput lost "
          "vs none (wall | CPU)")
    print(f"{'conc':>5} " + " ".join(f"{v:>15}" for v in variants) + " "
          + " ".join(f"{v + ' cost':>17}" for v in variants[1:]))
    for c, r in results.items():
        w, u = r["median_tok_s"], r["median_tok_per_cpu_s"]
        cells = " ".join(f"{w[v]:>6.1f} | {u[v]:>6.1f}" for v in variants)
        costs = " ".join(f"{r['cost_pct_wall'][v]:>6.1f}% | {r['cost_pct_cpu'][v]:>6.1f}%"
                         for v in variants[1:])
        print(f"{c:>5} {cells} {costs}")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
