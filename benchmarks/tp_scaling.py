"""Tensor-parallel scaling on this machine: TP=1 vs TP=2, measured interleaved.

    python benchmarks/tp_scaling.py [--config big] [--rounds 5]
        [--out benchmarks/results/tp_scaling.json]

Workloads (engine steps through `LLMEngine`, greedy, ignore_eos, prefix caching off):
  prefill   one 512-token prompt: the time of the step that computes it (TTFT without HTTP)
  decode b  b ∈ {1, 16} requests of 32-token prompts; the median time of the decode-only
            steps that follow (ms/step; tokens/s = b / step time)

Each variant runs in its own long-lived process; the main process takes one sample of
each per workload per round, in an order that rotates every round, so slow periods of
this shared, noisy machine hit all of them:

    tp1          TP=1 as `kvrelay serve` runs it: one process, torch's default threads
                 (one per core)
    tp1_1thread  TP=1 on one thread (what one TP=2 rank gets)
    tp2          TP=2: two ranks, each pinned to its own core with one thread

For every sample it records the share of the machine's CPU time that *other*
processes used meanwhile (`/proc/stat` minus the benchmark's own process family). The
report gives per-round TP2/TP1 ratios and their median — ratios of neighbouring samples
are what survive the noise — plus the medians of the raw numbers.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import CONFIGS, build_checkpoint, log

PREFILL_LEN = 512
DECODE_PROMPT = 32
DECODE_STEPS = 8
BATCHES = (1, 16)


# -- the engine process (one per TP size) ----------------------------------------------------
VARIANTS = {"tp1": (1, None), "tp1_1thread": (1, 1), "tp2": (2, None)}   # (TP, torch threads)


def engine_main(model: str, tp: int, threads: int | None, dtype: str, conn) -> None:
    import torch
    if threads:
        torch.set_num_threads(threads)
    from kvrelay.config import EngineArgs
    from kvrelay.engine.core import LLMEngine
    engine = LLMEngine(EngineArgs(model=model, dtype=dtype, tensor_parallel_size=tp,
                                  max_model_len=1024, enable_prefix_caching=False, max_num_seqs=64))
    workers = [w.pid for w in engine.executor.workers] if engine.executor else []
    conn.send(("ready", [os.getpid(), *workers], engine.model.weight_bytes()))
    rng = random.Random(tp)
    vocab = engine.model_config.vocab_size
    while True:
        try:
            cmd = conn.recv()
        except EOFError:                               # the benchmark process is gone
            cmd = ("stop",)
        if cmd[0] == "stop":
            engine.shutdown()
            try:
                conn.send(("stopped",))
            except OSError:
                pass
            return
        if cmd[0] == "prefill":
            conn.send(_prefill(engine, rng, vocab))
        elif cmd[0] == "decode":
            conn.send(_decode(engine, rng, vocab, cmd[1]))


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _prefill(engine, rng: random.Random, vocab: int) -> float:
    from kvrelay.sampling_params import SamplingParams
    engine.add_request(f"p{rng.random()}", _prompt(rng, vocab, PREFILL_LEN),
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()                                  # the whole prompt in one chunk
    seconds = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def _decode(engine, rng: random.Random, vocab: int, batch: int) -> float:
    from kvrelay.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1 + DECODE_STEPS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}-{rng.random()}", _prompt(rng, vocab, DECODE_PROMPT), params)
    engine.step()                                  # the prompts (and the first tokens)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- measuring -------------------------------------------------------------------------------
def _jiffies_all() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _jiffies_of(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError):
            pass
    return total


def measure(conn, cmd: tuple, family: list[int]) -> dict[str, float]:
    """One sample, and the share of all CPU time others used while it ran."""
    busy0, all0 = _jiffies_all()
    ours0 = _jiffies_of(family)
    conn.send(cmd)
    value = conn.recv()
    busy1, all1 = _jiffies_all()
    others = max((busy1 - busy0) - (_jiffies_of(family) - ours0), 0)
    return {"seconds": value, "others_cpu_share": round(others / max(all1 - all0, 1), 3)}


def machine() -> dict[str, Any]:
    import torch
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent, check=False).stdout.strip()
    return {"cpu_model": cpu, "usable_cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "kvrelay_commit": commit,
            "loadavg_start": Path("/proc/loadavg").read_text().split()[:3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="big")
    ap.add_argument("--dtype", default="float32",
                    help="float32: on an AVX2-only CPU 1.7-3.4x faster than bf16 "
                         "(docs/benchmarks.md, Machines)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_scaling.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    info = machine()
    model = build_checkpoint(args.config, CONFIGS[args.config])
    ctx = mp.get_context("spawn")
    engines: dict[str, Any] = {}
    for name, (tp, threads) in VARIANTS.items():
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=engine_main, args=(str(model), tp, threads, args.dtype, theirs),
                        daemon=False)
        p.start()
        ready = mine.recv()
        engines[name] = {"conn": mine, "proc": p, "family": ready[1], "weight_bytes": ready[2]}
        log(f"{name} ready (processes {ready[1]}, {ready[2] / 2**20:.0f} MiB of weights on rank 0)")
    family = [os.getpid()] + [pid for e in engines.values() for pid in e["family"]]
    workloads = [("prefill_512", ("prefill",))] + [(f"decode_b{b}", ("decode", b)) for b in BATCHES]
    samples: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in VARIANTS} for w, _ in workloads}
    names = list(VARIANTS)
    try:
        for _, cmd in workloads:                       # warm all (first-call kernel setup)
            for v in names:
                measure(engines[v]["conn"], cmd, family)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name, cmd in workloads:
                for v in order:
                    s = measure(engines[v]["conn"], cmd, family)
                    samples[name][v].append(s)
                    log(f"round {rnd}: {name} {v}: {s['seconds'] * 1e3:.1f} ms "
                        f"(others used {s['others_cpu_share']:.0%} of the CPUs)")
    finally:
        for e in engines.values():
            e["conn"].send(("stop",))
            e["conn"].recv()
            e["proc"].join(30)
    report = summarize(samples)
    out = {"machine": info, "config": args.config, "model_config": CONFIGS[args.config],
           "dtype": args.dtype,
           "checkpoint": str(model), "rounds": args.rounds, "prefill_len": PREFILL_LEN,
           "decode_prompt": DECODE_PROMPT, "decode_steps": DECODE_STEPS,
           "weight_bytes_rank0": {v: e["weight_bytes"] for v, e in engines.items()},
           "loadavg_end": Path("/proc/loadavg").read_text().split()[:3], "samples": samples,
           "summary": report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(report))
    return 0


def summarize(samples: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, float]]:
    """Medians per variant, and per-round time ratios of tp2 to each TP=1 variant."""
    report = {}
    for name, by in samples.items():
        sec = {v: [s["seconds"] for s in by[v]] for v in by}
        r: dict[str, float] = {f"{v}_ms": statistics.median(t) * 1e3 for v, t in sec.items()}
        for base in ("tp1", "tp1_1thread"):
            ratios = [b / a for a, b in zip(sec[base], sec["tp2"])]
            r[f"tp2_over_{base}"] = statistics.median(ratios)
            r[f"tp2_over_{base}_range"] = (min(ratios), max(ratios))
        r["others_cpu_share_median"] = statistics.median(s["others_cpu_share"] for v in by
                                                         for s in by[v])
        report[name] = r
    return report


def table(report: dict[str, dict[str, Any]]) -> str:
    rows = [("| workload | TP=1 (2 threads) | TP=1 (1 thread) | TP=2 (1 thread/rank) "
             "| TP2/TP1 time, median of rounds (range) | TP2/TP1-1-thread | others' CPU share |"),
            "|---|---|---|---|---|---|---|"]
    for name, r in report.items():
        unit = "ms" if name.startswith("prefill") else "ms/step"
        lo, hi = r["tp2_over_tp1_range"]
        lo1, hi1 = r["tp2_over_tp1_1thread_range"]
        rows.append(f"| {name} | {r['tp1_ms']:.1f} {unit} | {r['tp1_1thread_ms']:.1f} {unit} | "
                    f"{r['tp2_ms']:.1f} {unit} | {r['tp2_over_tp1']:.2f} ({lo:.2f}–{hi:.2f}) | "
                    f"{r['tp2_over_tp1_1thread']:.2f} ({lo1:.2f}–{hi1:.2f}) | "
                    f"{r['others_cpu_share_median']:.0%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
