"""Load and decode a big checkpoint offline: peak RSS vs its size, load time, decode tok/s.

    python benchmarks/big_model.py CKPT [--concurrency 1 4] [--output-len 32] [--out FILE]

Runs in this process: `LLM(CKPT, ...)` with a small context and KV budget, then for each
concurrency N one `LLM.generate` of N short prompts (greedy, `ignore_eos`, `--output-len`
tokens each) after a warm-up request. Decode tok/s = output tokens after the first
/ time after the first token of the slowest request (the prefill is left out).
Peak RSS is the process's VmHWM (file-backed pages of the mapped checkpoint included),
read after loading and again at the end; the page cache state is whatever it was before
the run (the JSON records the checkpoint's size and `uptime`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import cpu_flags, cpu_model, git_sha  # noqa: E402 -- after the sys.path insert


def proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def decode_rate(llm, n: int, output_len: int) -> dict[str, float]:
    from kvrelay import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = [[200006 + 0, 1000 + 7 * i, 2000 + i, 3000, 4000, 5000, 6000, 7000]
               for i in range(n)]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, first)                      # the prefill alone, same prompts
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"concurrency": n, "output_tokens": tokens, "total_s": round(total_s, 2),
            "prefill_s": round(prefill_s, 2),
            "decode_tok_s": round((tokens - n) / decode_s, 3),
            "end_to_end_tok_s": round(tokens / total_s, 3),
            "uptime": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    from kvrelay import LLM
    from kvrelay.model import kernels
    from kvrelay.model.layers.moe import moe_kernel_mode

    size = checkpoint_bytes(args.ckpt)
    result: dict = {"checkpoint": str(args.ckpt), "checkpoint_bytes": size,
                    "git": git_sha(), "cpu": cpu_model(),
                    "cpu_flags": [f for f in cpu_flags() if f.startswith(("avx", "amx"))],
                    "torch_threads": torch.get_num_threads(), "before": proc_status(),
                    "uptime_start": os.getloadavg()}
    t0 = time.perf_counter()
    llm = LLM(str(args.ckpt), max_model_len=args.max_model_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    result["load_s"] = round(time.perf_counter() - t0, 1)
    result["after_load"] = proc_status()
    status = kernels.status()
    result["moe_kernel"] = {"mode": moe_kernel_mode(), "status": repr(status)}
    print(json.dumps(result, indent=1), flush=True)
    result["runs"] = []
    for n in args.concurrency:
        run = decode_rate(llm, n, args.output_len)
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    result["end"] = proc_status()
    result["peak_rss_ratio"] = round(result["end"]["VmHWM"] / size, 3)
    result["load_peak_rss_ratio"] = round(result["after_load"]["VmHWM"] / size, 3)
    result["uptime_end"] = os.getloadavg()
    llm.shutdown()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
