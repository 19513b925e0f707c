#!/usr/bin/env python
"""The native paged decode attention op alone, in CPU time (one thread).

    python benchmarks/paged_decode_kernel.py [--batches 1,8,64] [--isa ""] [--repeats 200]
        [--shapes tiny,big] [--lens 200,400] [--cold]
    python benchmarks/paged_decode_kernel.py --generate [--layers 5] [--isa avx512,] [--rounds 3]

Shapes (--shapes): the tiny model's attention (`tiny`: 4 heads over 2 KV heads, head_dim
32), the big one's (`big`: 16 over 2, head_dim 64) and the embedded model's (`embedded`:
9 over 3, head_dim 64); bf16 KV cache in blocks of 16, contexts drawn from --lens
(default [200, 400]), blocks scattered over the cache, full attention and a 128-token
window; `20b`: gpt-oss-20b's 64 heads over 8, head_dim 64. Prints one JSON line per case:
µs per call (median of `--repeats` calls, thread CPU time) and G multiply-adds/s (2·D per
visible position per query head).

--cold: what a served model sees, where every layer's KV has left the caches by the next
step: the cache holds 8192 blocks (hundreds of MB, far beyond L3), the block tables are a
random draw from all of them, and a 96 MB buffer is read between timed calls.

--generate: offline `LLM.generate` on the tiny checkpoint with --layers layers (64
requests, prompts of 32-256 and outputs of 16-128 tokens, seeded, greedy, ignore_eos),
one thread: the thread CPU time of the whole call and of the decode attention calls (the
paged decode op and the fused rotary + KV write + decode op of decode-only steps, the
latter run on each ISA of the comma-separated --isa in turn, "" the best, --rounds times).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


SHAPES = {"tiny": (4, 2, 32), "big": (16, 2, 64), "embedded": (9, 3, 64),
          "20b": (64, 8, 64)}
COLD_BLOCKS = 8192


def case(batch: int, heads: int, kv_heads: int, head_dim: int, window: int, isa: str,
         repeats: int, lens_range: tuple[int, int] = (200, 400), cold: bool = False,
         ) -> dict[str, float | int | str]:
    g = torch.Generator().manual_seed(batch * 31 + heads)
    B = 16
    lens = torch.randint(lens_range[0], lens_range[1] + 1, (batch,), generator=g)
    width = int((lens.max() + B - 1) // B)
    NB = max(batch * width, COLD_BLOCKS if cold else 0) + 1
    table = (torch.randperm(NB - 1, generator=g)[: batch * width] + 1).view(batch, width)
    cache = torch.empty(2, NB, kv_heads, B, head_dim, dtype=torch.bfloat16)
    cache.normal_(generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g)
    op = torch.ops.kvrelay_kernels.paged_decode.default
    for _ in range(5):
        op(q, cache, table, lens, sinks, head_dim ** -0.5, window, isa)
    flush = torch.ones(24 << 20) if cold else None   # 96 MB: evicts L2 and L3
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()
        t0 = time.thread_time_ns()
        op(q, cache, table, lens, sinks, head_dim ** -0.5, window, isa)
        times.append(time.thread_time_ns() - t0)
    us = statistics.median(times) / 1e3
    visible = lens.clamp(max=window) if window else lens
    macs = int(visible.sum()) * heads * 2 * head_dim
    return dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window,
                isa=isa or "best", cold=cold, lens=f"{lens_range[0]}-{lens_range[1]}",
                us=round(us, 1), gmacs=round(macs / us / 1e3, 2),
                kv_mb=round(int(visible.sum()) * kv_heads * head_dim * 4 / 1e6, 2))


def generate(layers: int, isas: list[str], rounds: int) -> list[dict[str, float | str]]:
    from common import CONFIGS, build_checkpoint

    from kvrelay import LLM, SamplingParams
    from kvrelay.model.layers import paged_decode
    path = build_checkpoint("tiny", CONFIGS["tiny"] | dict(num_hidden_layers=layers))
    llm = LLM(str(path), dtype="bfloat16", max_num_seqs=64, max_model_len=512,
              max_num_batched_tokens=4096, enable_prefix_caching=False, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2000, (int(n),), generator=g).tolist()
               for n in torch.randint(32, 257, (64,), generator=g)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(16, 129, (64,), generator=g)]
    spent = {"ns": 0, "calls": 0}
    inner, inner_fused = paged_decode.decode, paged_decode.rotary_decode
    fused_op = torch.ops.kvrelay_kernels.rotary_decode_attention.default
    isa = {"name": ""}

    def timed(*args, **kwargs):
        t0 = time.thread_time_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent["ns"] += time.thread_time_ns() - t0
            spent["calls"] += 1

    def timed_fused(*args):   # the fused op (decode-only steps) on the ISA of this round
        t0 = time.thread_time_ns()
        try:
            return fused_op(*args, isa["name"])
        finally:
            spent["ns"] += time.thread_time_ns() - t0
            spent["calls"] += 1

    llm.generate(prompts[:8], params[:8])       # warm-up
    paged_decode.decode, paged_decode.rotary_decode = timed, timed_fused
    rows = []
    for _ in range(rounds):          # ISAs alternated in one process: ratios, not absolutes
        for name in isas:
            isa["name"] = name
            spent.update(ns=0, calls=0)
            t0 = time.thread_time_ns()
            llm.generate(prompts, params)
            total = time.thread_time_ns() - t0
            rows.append(dict(layers=layers, isa=name or "best",
                             generate_cpu_s=round(total / 1e9, 3),
                             attention_cpu_s=round(spent["ns"] / 1e9, 3),
                             calls=spent["calls"], share=round(spent["ns"] / total, 3)))
    paged_decode.decode, paged_decode.rotary_decode = inner, inner_fused
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--isa", default="")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--shapes", default="tiny,big", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--lens", default="200,400", help="context lengths: min,max")
    ap.add_argument("--cold", action="store_true", help="KV out of the caches (see above)")
    ap.add_argument("--generate", action="store_true", help="offline LLM.generate instead")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="--generate: runs per ISA")
    args = ap.parse_args()
    from kvrelay.model import kernels
    status = kernels.status()
    if not status.available:
        raise SystemExit(f"native kernels unavailable: {status.reason}")
    torch.set_num_threads(1)
    if args.generate:
        for row in generate(args.layers, args.isa.split(","), args.rounds):
            print(json.dumps(row), flush=True)
        return
    lo, hi = (int(x) for x in args.lens.split(","))
    for batch in (int(b) for b in args.batches.split(",")):
        for heads, kv_heads, head_dim in (SHAPES[s] for s in args.shapes.split(",")):
            for window in (0, 128):
                print(json.dumps(case(batch, heads, kv_heads, head_dim, window, args.isa,
                                      args.repeats, (lo, hi), args.cold)), flush=True)


if __name__ == "__main__":
    main()
