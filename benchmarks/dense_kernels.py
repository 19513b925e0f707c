"""Weight bandwidth of the decode-sized dense matmuls: the native kernel vs torch F.linear.

    python benchmarks/dense_kernels.py [--shapes all|20b|embedded|NAME,...] [--rows 1,4,16]
        [--threads 1,2] [--isas best|all|avx2,...] [--seconds 0.4] [--library SO]
        [--out FILE.json]

Decode on a CPU is memory-bound: every weight byte is read once per step, so the figure
of merit is GB/s of weights streamed. For each shape, row count and thread count this
times y = x·Wᵀ (bf16 x and W, no bias) with `kvrelay_kernels::dense_linear` (each ISA
variant asked for) and with `F.linear`, calls interleaved so machine noise hits them
alike. Small matrices would stay in cache if one copy were timed over and over, unlike a
real step (the other layers' weights pass through the caches between two calls of this
one): every call therefore takes the next of enough copies to fill `--pool-mb` (256 MB),
so the weights come from DRAM as they do in a step.

Reported per cell: GB/s of weights from the median call (wall), and GB of weights per CPU
second (`time.process_time`, all threads, over all calls): for one thread the rate it
streams at while it runs, robust to a loaded machine where wall time measures the queue;
for two, the rate per thread (it counts a spinning OpenMP thread as busy, and a second
thread the kernel leaves idle on a small matrix not at all). Compare ratios within one run;
the header prints the CPU flags, torch's version and the load average.

Shapes (synthetic weights, never a checkpoint): gpt-oss-20b LM head 201088x2880 (1.16 GB),
qkv 5120x2880, o_proj 2880x4096; the embedded model (SmolLM2-135M as gpt-oss) qkv 960x576,
o_proj 576x576 and LM head 49152x576; the offline benchmark's tiny model (hidden 128) qkv
256x128, o_proj 128x128, router 8x128 and LM head 2048x128 (`--shapes tiny --rows
17,32,64,128`: where F.linear's fixed cost per call decides, linear.py DENSE_SMALL_CALL_MACS).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# as `kvrelay serve` does (cli.py): OpenMP threads spin briefly at barriers, then sleep
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import torch  # after the OpenMP setting: libgomp reads it when loaded
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_flags, cpu_model  # noqa: E402 -- after the sys.path insert

from kvrelay.model import kernels  # noqa: E402 -- after the sys.path insert

SHAPES: dict[str, tuple[int, int]] = {   # name: (N output features, K input features)
    "20b.lm_head": (201088, 2880),
    "20b.qkv": (5120, 2880),
    "20b.o_proj": (2880, 4096),
    "emb.qkv": (960, 576),
    "emb.o_proj": (576, 576),
    "emb.lm_head": (49152, 576),
    "tiny.qkv": (256, 128),
    "tiny.o_proj": (128, 128),
    "tiny.router": (8, 128),
    "tiny.lm_head": (2048, 128),
}
GROUPS = {"all": [s for s in SHAPES if not s.startswith("tiny")],
          "20b": [s for s in SHAPES if s.startswith("20b")],
          "embedded": [s for s in SHAPES if s.startswith("emb")],
          "tiny": [s for s in SHAPES if s.startswith("tiny")]}


def weight_pool(n: int, k: int, pool_bytes: int) -> list[torch.Tensor]:
    """Enough random bf16 copies of an [n, k] matrix to fill pool_bytes (at least one)."""
    copies = max(1, -(-pool_bytes // (n * k * 2)))
    g = torch.Generator().manual_seed(n * 7 + k)
    return [torch.empty(n, k, dtype=torch.bfloat16).normal_(generator=g) for _ in range(copies)]


def time_calls(fn: Callable[[torch.Tensor], object], pool: list[torch.Tensor],
               seconds: float) -> tuple[list[float], float]:
    """(wall s of each call, process CPU s of all calls) cycling over the pool's copies."""
    for w in pool[:2]:
        fn(w)                                           # warm: first-touch, op lookup
    walls: list[float] = []
    c0 = time.process_time()
    end = time.perf_counter() + seconds
    while len(walls) < 3 or time.perf_counter() < end:
        w = pool[len(walls) % len(pool)]
        t0 = time.perf_counter()
        fn(w)
        walls.append(time.perf_counter() - t0)
    return walls, time.process_time() - c0


def variants(isas: list[str]) -> dict[str, Callable[[torch.Tensor, torch.Tensor], object]]:
    op = torch.ops.kvrelay_kernels.dense_linear.default
    out: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {}
    for isa in isas:
        out[f"native {isa}"] = lambda x, w, isa=isa: op(x, w, None, isa)
    out["torch"] = lambda x, w: F.linear(x, w)
    return out


def run_cell(shape: str, pool: list[torch.Tensor], rows: int, threads: int,
             fns: dict[str, Callable], seconds: float) -> list[dict]:
    n, k = SHAPES[shape]
    torch.set_num_threads(threads)
    x = torch.randn(rows, k).to(torch.bfloat16)
    gb = n * k * 2 / 1e9
    walls: dict[str, list[float]] = {name: [] for name in fns}
    cpu = dict.fromkeys(fns, 0.0)
    for _ in range(3):                                   # interleaved rounds
        for name, fn in fns.items():
            times, spent = time_calls(lambda w, fn=fn: fn(x, w), pool, seconds / 3)
            walls[name] += times
            cpu[name] += spent
    cells = []
    for name, times in walls.items():
        wall, per_call = statistics.median(times), cpu[name] / len(times)
        cells.append({"shape": shape, "rows": rows, "threads": threads, "variant": name,
                      "median_ms": wall * 1e3, "cpu_ms": per_call * 1e3,
                      "gbps_wall": gb / wall,
                      "gb_per_cpu_s": gb / per_call if per_call > 0 else float("nan")})
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isas", default="best", help="best, all, or a list of dense ISAs")
    ap.add_argument("--seconds", type=float, default=0.4, help="per cell and variant")
    ap.add_argument("--pool-mb", type=int, default=256)
    ap.add_argument("--library", type=Path,
                    help="load this build of the kernels (say, main's, for a before/after) "
                         "instead of building the worktree's")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.library:
        torch.ops.load_library(str(a.library))
    else:
        status = kernels.status()
        if not status.available:
            sys.exit(f"native kernels unavailable: {status.reason}")
    have = list(torch.ops.kvrelay_kernels.dense_isas())
    isas = {"best": have[:1], "all": [i for i in have if i != "generic"]}.get(
        a.isas, a.isas.split(","))
    shapes = GROUPS.get(a.shapes, a.shapes.split(","))
    header = {"library": str(a.library or kernels.status().library), "cpu": cpu_model(),
              "cpu_flags": cpu_flags(), "dense_isas": have,
              "torch": torch.__version__, "python": platform.python_version(),
              "load": os.getloadavg()}
    print(json.dumps(header))
    fns = variants(isas)
    cells: list[dict] = []
    print(f"{'shape':12} {'MB':>7} {'rows':>4} {'thr':>3} {'variant':>20} {'p50 ms':>8} "
          f"{'GB/s wall':>9} {'GB/cpu-s':>8} {'x torch':>7}")
    for shape in shapes:
        n, k = SHAPES[shape]
        pool = weight_pool(n, k, a.pool_mb << 20)
        for rows in map(int, a.rows.split(",")):
            for threads in map(int, a.threads.split(",")):
                cell = run_cell(shape, pool, rows, threads, fns, a.seconds)
                torch_ms = next(c["median_ms"] for c in cell if c["variant"] == "torch")
                for c in cell:
                    print(f"{shape:12} {n * k * 2 / 1e6:7.1f} {rows:4} {threads:3} "
                          f"{c['variant']:>20} {c['median_ms']:8.3f} {c['gbps_wall']:9.1f} "
                          f"{c['gb_per_cpu_s']:8.1f} {torch_ms / c['median_ms']:7.2f}", flush=True)
                cells.extend(cell)
        del pool
    header["load_after"] = os.getloadavg()
    print(json.dumps({"load_after": header["load_after"]}))
    if a.out:
        a.out.write_text(json.dumps({**header, "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
