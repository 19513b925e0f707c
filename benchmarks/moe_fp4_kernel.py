"""MXFP4 expert decode as a weight stream, per ISA build, as a bf16 and a float32 model see it.

    python benchmarks/moe_fp4_kernel.py [--configs 20b,tiny] [--tokens 1,2,4,8]
        [--threads 1,2] [--isas avx512_bf16,avx512] [--x bf16,f32] [--rounds 20]

`kernels.moe_experts` alone (no router, no Python layer), like `moe_kernels.py --kernel`,
but with the hidden states a bf16 model gives the experts (bf16 tensors: the
"avx512_bf16" build multiplies them with vdpbf16ps in gate_up) and, with `--x f32`, a
float32 model's (fp32 values: every build takes the fp32 route). Token t is routed to
experts t·k .. t·k + k - 1, so T tokens touch min(T·k, E) experts; each call reads another
copy of the weights (≥ 192 MB per pass: nothing comes from the L3). For every (ISA,
threads, x) the calls alternate round by round, so machine noise hits them alike; reported:
the best wall time per call (GB/s of expert bytes) and the best main-thread CPU time
(`time.thread_time`, one thread's work without the queue for a core on a loaded machine).
`--resident` reads one copy (cache-resident where it fits: the compute rate).
Writes benchmarks/results/moe_fp4_kernel.json with the CPU flags and load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "20000")   # as `kvrelay serve` does (cli.py)

import torch  # after the OpenMP setting: libgomp reads it when loaded

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_kernels import SHAPES, kernel_weights, machine, stream_row, stream_text  # noqa: E402 -- after sys.path

from kvrelay.model import kernels  # noqa: E402 -- after the sys.path insert


def run(name: str, tokens: list[int], rounds: int, threads: list[int], isas: list[str],
        x_kinds: list[str], resident: bool = False) -> list[dict]:
    shape = SHAPES[name]
    H, E, k = shape["hidden"], shape["experts"], shape["top_k"]
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in tokens:
        ids = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E
        local = torch.searchsorted(ids.unique(), ids)
        experts = int(ids.unique().numel())
        weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
        x32 = torch.randn(T, H, generator=g)
        xs = {"bf16": x32.bfloat16(), "f32": x32}
        one = kernel_weights(shape, "mxfp4", experts, g)
        copies = 1 if resident else max(1, -(-(192 << 20) // one["bytes"]))
        layers = [one] + [kernel_weights(shape, "mxfp4", experts, g) for _ in range(copies - 1)]
        keys = [(isa, t, xk) for isa in isas for t in threads for xk in x_kinds]
        best = {key: float("inf") for key in keys}
        best_cpu = {key: float("inf") for key in keys}
        for r in range(rounds + 1):                         # round 0 warms up
            for key in keys:
                isa, t, xk = key
                torch.set_num_threads(t)
                for layer in layers:
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    kernels.moe_experts(xs[xk], weights, local, 0, layer["gate_up"],
                                        layer["gate_up_bias"], layer["down"],
                                        layer["down_bias"], 1.702, 7.0, isa)
                    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                    if r:
                        best[key] = min(best[key], wall)
                        best_cpu[key] = min(best_cpu[key], cpu)
        for key in keys:
            isa, t, xk = key
            wall, cpu = best[key], max(best_cpu[key], 1e-9)   # thread_time ticks: ~1 us
            row = stream_row({"shape": name, "tokens": T, "experts": experts, "isa": isa,
                              "threads": t, "x": xk}, one["bytes"], wall, cpu)
            rows.append(row)
            print(f"{name:5} T={T} experts={experts:2} {isa:11} t={t} x={xk:4} "
                  f"{stream_text(row)}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="20b,tiny")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isas", default="", help="default: every build this CPU runs but generic")
    ap.add_argument("--x", default="bf16", help="bf16 (a bf16 model), f32, or both: bf16,f32")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--resident", action="store_true",
                    help="one copy of the weights, read from the caches where they fit: "
                         "the kernels' compute rate rather than the memory's")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_fp4_kernel.json"))
    args = ap.parse_args()
    info = machine()
    print(json.dumps(info), flush=True)
    isas = args.isas.split(",") if args.isas else \
        [i for i in kernels.status().isas if i != "generic"]
    rows = []
    for name in args.configs.split(","):
        rows += run(name, [int(t) for t in args.tokens.split(",")], args.rounds,
                    [int(t) for t in args.threads.split(",")], isas, args.x.split(","),
                    args.resident)
    info["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
