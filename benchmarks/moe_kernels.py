"""One MoE layer per decode step: native kernels vs the PyTorch reference path.

    python benchmarks/moe_kernels.py [--configs tiny,20b] [--tokens 1,8,64] [--rounds 5]

For each layer shape and token count, times `MoE.forward` (router + experts) with the
expert weights in MXFP4 / bf16 / fp32 and `KVRELAY_MOE_KERNEL` native vs torch. Variants
are timed round-robin (one call each per round, median over rounds) so machine noise
hits them alike: compare the ratios of one run, not numbers across runs. Prints a table
and writes JSON (benchmarks/results/moe_kernels.json) with the CPU flags, versions and
load average.

Shapes: "tiny" is benchmarks/common.py's tiny config (hidden 128, 8 experts top-2,
intermediate 128); "20b" is one gpt-oss-20b layer (hidden 2880, 32 experts top-4,
intermediate 2880). Weights are random MXFP4 codes (scales 2^-8..2^-4); the bf16 and
fp32 variants hold exactly the dequantised values.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrelay.model import kernels, mxfp4
from kvrelay.model.layers.moe import MoE
from kvrelay.model.parallel import ParallelContext

SHAPES = {
    "tiny": {"hidden": 128, "intermediate": 128, "experts": 8, "top_k": 2},
    "20b": {"hidden": 2880, "intermediate": 2880, "experts": 32, "top_k": 4},
}
# (label, expert storage, model dtype, KVRELAY_MOE_KERNEL)
VARIANTS = [
    ("mxfp4 native", "mxfp4", torch.bfloat16, "native"),
    ("mxfp4 torch", "mxfp4", torch.bfloat16, "torch"),
    ("bf16 native", "dense", torch.bfloat16, "native"),
    ("bf16 torch", "dense", torch.bfloat16, "torch"),
    ("fp32 native", "dense", torch.float32, "native"),
    ("fp32 torch", "dense", torch.float32, "torch"),
]


def random_packed(e: int, rows: int, cols: int, g: torch.Generator) -> mxfp4.MXFP4Tensor:
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(119, 124, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
    return mxfp4.MXFP4Tensor(blocks, scales)


def make_layer(shape: dict, storage: str, dtype: torch.dtype,
               packed: tuple[mxfp4.MXFP4Tensor, mxfp4.MXFP4Tensor], seed: int) -> MoE:
    H, I, E, k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]
    moe = MoE(H, I, E, k, ParallelContext(), dtype, 1.702, 7.0, storage == "mxfp4")
    g = torch.Generator().manual_seed(seed)
    moe.router.weight.copy_(torch.randn(E, H, generator=g))
    moe.router.bias.copy_(torch.randn(E, generator=g))
    moe.experts.gate_up_bias.copy_(torch.randn(E, 2 * I, generator=g) * 0.1)
    moe.experts.down_bias.copy_(torch.randn(E, H, generator=g) * 0.1)
    gate_up, down = packed
    if storage == "mxfp4":
        moe.experts.gate_up, moe.experts.down = gate_up, down
    else:
        for e in range(E):      # one expert at a time: the 20b layer is 1.6 GB in bf16
            moe.experts.gate_up[e].copy_(gate_up.expert(e, torch.float32))
            moe.experts.down[e].copy_(down.expert(e, torch.float32))
    return moe


def time_round(layers: dict, xs: dict, label: str) -> float:
    storage_mode = next(v for v in VARIANTS if v[0] == label)
    os.environ["KVRELAY_MOE_KERNEL"] = storage_mode[3]
    x = xs[storage_mode[2]]
    start = time.perf_counter()
    with torch.inference_mode():
        layers[label](x)
    return time.perf_counter() - start


def run_shape(name: str, tokens: list[int], rounds: int, variants: list[str]) -> list[dict]:
    shape = SHAPES[name]
    H, I, E = shape["hidden"], shape["intermediate"], shape["experts"]
    g = torch.Generator().manual_seed(0)
    packed = (random_packed(E, 2 * I, H, g), random_packed(E, H, I, g))
    results = []
    for label in variants:
        _, storage, dtype, _ = next(v for v in VARIANTS if v[0] == label)
        layers = {label: make_layer(shape, storage, dtype, packed, seed=1)}
        results.append({"variant": label, "layer": layers[label],
                            "expert_bytes": layers[label].experts.nbytes()})
    rows = []
    for T in tokens:
        x32 = torch.randn(T, H, generator=g)
        xs = {torch.float32: x32, torch.bfloat16: x32.bfloat16()}
        layers = {r["variant"]: r["layer"] for r in results}
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(2):                                  # warm-up (and the JIT build)
            for v in variants:
                time_round(layers, xs, v)
        for _ in range(rounds):
            for v in variants:
                samples[v].append(time_round(layers, xs, v))
        base = statistics.median(samples.get("bf16 torch") or samples[variants[0]])
        for r in results:
            ms = statistics.median(samples[r["variant"]]) * 1e3
            rows.append({"shape": name, "tokens": T, "variant": r["variant"], "ms": round(ms, 3),
                             "speed_vs_bf16_torch": round(base * 1e3 / ms, 2),
                             "expert_bytes": r["expert_bytes"]})
            print(f"{name:5} T={T:3} {r['variant']:13} {ms:9.3f} ms  "
                  f"{base * 1e3 / ms:6.2f}x bf16-torch  "
                  f"experts {r['expert_bytes'] / 2**20:8.1f} MiB",
                  flush=True)
    return rows


def machine() -> dict:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1]
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu": platform.processor() or platform.machine(),
                "flags": [f for f in wanted if f in flags.split()], "torch": torch.__version__,
                "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
                "kernels": kernels.status().isa, "kernels_reason": kernels.status().reason}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,20b")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_kernels.json"))
    args = ap.parse_args()
    info = machine()
    print(json.dumps(info), flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = args.variants.split(",")
    rows = []
    for name in args.configs.split(","):
        chosen = [v for v in variants if not (name == "20b" and v.startswith("fp32"))] \
            if args.variants == ap.get_default("variants") else variants
        rows += run_shape(name, tokens, args.rounds, chosen)
    info["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
