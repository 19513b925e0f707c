"""One MoE layer per decode step: native kernels vs the PyTorch reference path.

    python benchmarks/moe_kernels.py [--configs tiny,20b] [--tokens 1,8,64] [--rounds 5]
        [--threads 1,2] [--variants "mxfp4 native,bf16 native,bf16 torch"]
    python benchmarks/moe_kernels.py --decode [--rounds 3]
    python benchmarks/moe_kernels.py --kernel [--configs embedded,20b] [--tokens 1,4,16]
        [--threads 1,2] [--isas avx512,avx2] [--rounds 20]
    python benchmarks/moe_kernels.py --overhead [--configs peers] [--tokens 1,16]

For each layer shape and token count, times `MoE.forward` (router + experts) with the
expert weights in MXFP4 / bf16 / fp32 and `KVRELAY_MOE_KERNEL` native vs torch. Variants
are timed round-robin (one call each per round, median over rounds) so machine noise
hits them alike: compare the ratios of one run, not numbers across runs. `--threads 1,2`
times each variant at every intra-op thread count (the native kernels split their work
over torch's OpenMP threads; at one thread they run exactly as the serial build did).
Wall time and process CPU time (all threads) are both reported. Prints a table and
writes JSON (benchmarks/results/moe_kernels.json) with the CPU flags, versions and
load average.

Shapes: "tiny" is benchmarks/common.py's tiny config (hidden 128, 8 experts top-2,
intermediate 128); "peers" the MoE of benchmarks/peers.py's tiny model (hidden 32,
8 experts top-2, intermediate 32); "big" benchmarks/common.py's big config (hidden 1024,
32 experts top-4, intermediate 1024); "20b" is one gpt-oss-20b layer (hidden 2880, 32 experts top-4,
intermediate 2880). Weights are random MXFP4 codes (scales 2^-8..2^-4); the bf16 and
fp32 variants hold exactly the dequantised values.

--decode: end to end instead. `LLM.generate` (greedy, ignore_eos) on benchmarks/common.py's
tiny checkpoint in bf16 and the same weights with MXFP4 experts, at concurrency 1 and 16
(64-token prompts, 128 new tokens each), KVRELAY_MOE_KERNEL=torch vs auto alternating
in one process (the mode is read per forward); output tokens per second, median of rounds.

--kernel: the expert computation alone (`kernels.moe_experts`, no router, no Python layer)
as a weight stream: GB/s of the expert bytes one call reads (each distinct routed expert's
gate_up and down once). Token t is routed to experts t·k .. t·k + k - 1 (modulo the layer's
experts), so T tokens use min(T·k, E) distinct experts with ~T·k/E tokens each (embedded,
16 tokens: 8 tokens on each of the 2 experts; 20b, 4 tokens: 16 experts, one token each).
Each call reads a different copy of the weights (enough copies to stream ≥ 192 MB per
pass, so nothing is served from the 32 MB L3). Reports the best (min) wall time per call
over rounds, and the best main-thread CPU time (`time.thread_time`, the work of one thread
without the queue for a core on a loaded machine) for each ISA build and thread count.

--overhead: the per-call cost of one decode step's experts call outside the kernel, on a
shape whose kernel time is ~0 ("peers": hidden 32), one thread: the eager decode path's
call before session 6's experts2 (`Experts.forward` + the MoE all-reduce, activations
cast to fp32 and back) against `Experts.forward` (arguments worked out once, bf16 given to
the kernel as it is), and the bare op with the same arguments. Best main-thread CPU µs
per call over rounds of 2,000 calls, alternating.
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

# as `kvrelay serve` does (cli.py): OpenMP threads spin briefly at barriers, then sleep,
# so a preempted partner thread on shared cores costs a wake-up, not a core of spinning
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import torch  # after the OpenMP setting: libgomp reads it when loaded

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvrelay.model import kernels, mxfp4  # noqa: E402 -- after the sys.path insert
from kvrelay.model.layers.moe import MoE  # noqa: E402 -- after the sys.path insert
from kvrelay.model.parallel import ParallelContext  # noqa: E402 -- after the sys.path insert

SHAPES = {
    "tiny": {"hidden": 128, "intermediate": 128, "experts": 8, "top_k": 2},
    "peers": {"hidden": 32, "intermediate": 32, "experts": 8, "top_k": 2},
    "big": {"hidden": 1024, "intermediate": 1024, "experts": 32, "top_k": 4},
    "20b": {"hidden": 2880, "intermediate": 2880, "experts": 32, "top_k": 4},
    # the embedded model (SmolLM2-135M as gpt-oss); --kernel and MoE.forward, bf16
    "embedded": {"hidden": 576, "intermediate": 1536, "experts": 2, "top_k": 1},
}
# --kernel: expert storage per shape (the embedded model's experts are bf16)
KERNEL_STORAGE = {"tiny": "mxfp4", "peers": "mxfp4", "big": "mxfp4", "20b": "mxfp4",
                  "embedded": "bf16"}
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
    H, I, E, k = shape["hidden"], shape["intermediate"], shape["experts"], shape["top_k"]  # noqa: E741 -- I as in the shape notation
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


def time_round(layers: dict, xs: dict, key: tuple[str, int],
               cpu: list[float] | None = None) -> float:
    """Wall seconds of one call of variant `key` = (label, threads); its CPU seconds
    (the whole process: every OpenMP thread, spin-waits at barriers included) go to
    `cpu`. On a loaded machine CPU time is the work itself without the queue for a core."""
    label, threads = key
    storage_mode = next(v for v in VARIANTS if v[0] == label)
    os.environ["KVRELAY_MOE_KERNEL"] = storage_mode[3]
    torch.set_num_threads(threads)
    x = xs[storage_mode[2]]
    start, start_cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        layers[label](x)
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def run_shape(name: str, tokens: list[int], rounds: int, variants: list[str],
              threads: list[int], slow_s: float) -> list[dict]:
    shape = SHAPES[name]
    H, I, E = shape["hidden"], shape["intermediate"], shape["experts"]  # noqa: E741 -- I as in the shape notation
    g = torch.Generator().manual_seed(0)
    packed = (random_packed(E, 2 * I, H, g), random_packed(E, H, I, g))
    layers, expert_bytes = {}, {}
    for label in variants:
        _, storage, dtype, _ = next(v for v in VARIANTS if v[0] == label)
        layers[label] = make_layer(shape, storage, dtype, packed, seed=1)
        expert_bytes[label] = layers[label].experts.nbytes()
    keys = [(v, t) for v in variants for t in threads]
    base_key = ("bf16 torch", max(threads)) if "bf16 torch" in variants else keys[0]
    rows = []
    for T in tokens:
        x32 = torch.randn(T, H, generator=g)
        xs = {torch.float32: x32, torch.bfloat16: x32.bfloat16()}
        samples: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
        cpu: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
        slow = set()
        for key in keys:                                   # warm-up (and the JIT build)
            if time_round(layers, xs, key) > slow_s:   # the reference MXFP4 path at 20b size
                slow.add(key)
                samples[key].append(time_round(layers, xs, key, cpu[key]))
        for _ in range(rounds):
            for key in keys:
                if key not in slow:
                    samples[key].append(time_round(layers, xs, key, cpu[key]))
        base = statistics.median(samples[base_key])
        base_cpu = statistics.median(cpu[base_key])
        for key in keys:
            ms = statistics.median(samples[key]) * 1e3
            cpu_ms = statistics.median(cpu[key]) * 1e3
            rows.append({"shape": name, "tokens": T, "variant": key[0], "threads": key[1],
                         "ms": round(ms, 3), "samples": len(samples[key]),
                         "speed_vs_bf16_torch": round(base * 1e3 / ms, 2),
                         "cpu_ms": round(cpu_ms, 3),
                         "cpu_speed_vs_bf16_torch": round(base_cpu * 1e3 / cpu_ms, 2),
                         "expert_bytes": expert_bytes[key[0]]})
            print(f"{name:5} T={T:3} {key[0]:13} t={key[1]} {ms:9.3f} ms  "
                  f"{base * 1e3 / ms:6.2f}x bf16-torch  cpu {cpu_ms:9.3f} ms "
                  f"{base_cpu * 1e3 / cpu_ms:6.2f}x  "
                  f"experts {expert_bytes[key[0]] / 2**20:8.1f} MiB",
                  flush=True)
    return rows


def kernel_weights(shape: dict, storage: str, experts: int, g: torch.Generator) -> dict:
    """One layer's weights for `experts` experts (only the routed ones are allocated)."""
    H, I = shape["hidden"], shape["intermediate"]  # noqa: E741 -- I as in the shape notation
    if storage == "mxfp4":
        gu, dn = random_packed(experts, 2 * I, H, g), random_packed(experts, H, I, g)
        gate_up, down = (gu.blocks, gu.scales), (dn.blocks, dn.scales)
        nbytes = gu.nbytes() + dn.nbytes()
    else:
        dtype = torch.bfloat16 if storage == "bf16" else torch.float32
        gate_up = ((torch.randn(experts, 2 * I, H, generator=g) * 0.05).to(dtype), None)
        down = ((torch.randn(experts, H, I, generator=g) * 0.05).to(dtype), None)
        nbytes = (gate_up[0].numel() + down[0].numel()) * gate_up[0].element_size()
    return {"gate_up": gate_up, "down": down, "bytes": nbytes,
            "gate_up_bias": torch.randn(experts, 2 * I, generator=g) * 0.1,
            "down_bias": torch.randn(experts, H, generator=g) * 0.1}


def run_kernel(name: str, tokens: list[int], rounds: int, threads: list[int],
               isas: list[str]) -> list[dict]:
    """GB/s of expert weights streamed by one `kernels.moe_experts` call (see --kernel)."""
    shape = SHAPES[name]
    storage = KERNEL_STORAGE[name]
    H, E, k = shape["hidden"], shape["experts"], shape["top_k"]
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in tokens:
        ids = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E       # [T, k]
        used = ids.unique()
        local = torch.searchsorted(used, ids)               # dense local ids [0, len(used))
        weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
        x = torch.randn(T, H, generator=g)
        if storage == "bf16":        # a bf16 model's hidden states: exactly bf16 values
            x = x.bfloat16().float()
        one = kernel_weights(shape, storage, len(used), g)
        copies = max(1, -(-(192 << 20) // one["bytes"]))
        layers = [one] + [kernel_weights(shape, storage, len(used), g) for _ in range(copies - 1)]
        keys = [(isa, t) for isa in isas for t in threads]
        best = {key: float("inf") for key in keys}
        best_cpu = {key: float("inf") for key in keys}
        for r in range(rounds + 1):                         # round 0 warms up
            for isa, t in keys:
                torch.set_num_threads(t)
                for layer in layers:
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    kernels.moe_experts(x, weights, local, 0, layer["gate_up"],
                                        layer["gate_up_bias"], layer["down"],
                                        layer["down_bias"], 1.702, 7.0, isa)
                    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                    if r:
                        best[(isa, t)] = min(best[(isa, t)], wall)
                        best_cpu[(isa, t)] = min(best_cpu[(isa, t)], cpu)
        for isa, t in keys:
            row = stream_row({"shape": name, "storage": storage, "tokens": T,
                              "experts": len(used), "isa": isa, "threads": t},
                             one["bytes"], best[(isa, t)], best_cpu[(isa, t)])
            rows.append(row)
            print(f"{name:8} {storage:5} T={T:3} experts={len(used):2} {isa:7} t={t} "
                  f"{stream_text(row)}", flush=True)
    return rows


def stream_row(label: dict, expert_bytes: int, wall: float, cpu: float) -> dict:
    """A weight-stream result: `label` plus the best wall and thread-CPU time per call (s)
    and the GB/s of expert bytes each gives."""
    return label | {"expert_bytes": expert_bytes, "best_ms": round(wall * 1e3, 4),
                    "gb_s": round(expert_bytes / wall / 1e9, 2),
                    "best_thread_cpu_ms": round(cpu * 1e3, 4),
                    "gb_per_cpu_s": round(expert_bytes / cpu / 1e9, 2)}


def stream_text(row: dict) -> str:
    return (f"{row['expert_bytes'] / 1e6:7.2f} MB  best {row['best_ms']:8.3f} ms "
            f"{row['gb_s']:6.1f} GB/s  thread cpu {row['best_thread_cpu_ms']:8.3f} ms "
            f"{row['gb_per_cpu_s']:6.1f} GB/cpu-s")


def mxfp4_copy(path: Path) -> Path:
    """The checkpoint at `path` with its experts rewritten in the official MXFP4 layout."""
    from safetensors.torch import load_file, save_file
    out = path.with_name(path.name + "-mxfp4")
    if (out / "config.json").is_file():
        return out
    import shutil
    shutil.copytree(path, out, dirs_exist_ok=True)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(name).float()                              # [E, in, out]
        blocks, scales = mxfp4.quantize(w.transpose(1, 2))  # [E, out, in/32, 16], [E, out, in/32]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def run_decode(rounds: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import CONFIGS, build_checkpoint

    from kvrelay import LLM, SamplingParams
    bf16 = build_checkpoint("tiny", CONFIGS["tiny"])
    paths = {"bf16": bf16, "mxfp4": mxfp4_copy(bf16)}
    rows = []
    for concurrency in (1, 16):
        prompts = [[(7 * i + j) % 2000 + 10 for j in range(64)] for i in range(concurrency)]
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llms = {name: LLM(str(p), dtype="bfloat16", max_num_seqs=64, seed=0,
                          enable_prefix_caching=False) for name, p in paths.items()}
        samples: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds + 1):                             # round 0 warms up
            for name, llm in llms.items():
                for mode in ("torch", "auto"):
                    os.environ["KVRELAY_MOE_KERNEL"] = mode
                    start = time.perf_counter()
                    out = llm.generate(prompts, params)
                    seconds = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in out)
                    if r:
                        samples.setdefault((name, mode), []).append(tokens / seconds)
        base = statistics.median(samples[("bf16", "torch")])
        for (name, mode), tps in samples.items():
            experts = sum(layer.mlp.experts.nbytes() for layer in llms[name].engine.model.layers)
            row = {"checkpoint": name, "moe_kernel": mode, "concurrency": concurrency,
                   "tok_s": round(statistics.median(tps), 1),
                   "vs_bf16_torch": round(statistics.median(tps) / base, 2),
                   "expert_bytes": experts}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for llm in llms.values():
            llm.shutdown()
    return rows


def _forward_all_reduce(ex, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
    return ex.ctx.comm.all_reduce(ex.forward(x, weights, ids))


def run_overhead(name: str, tokens: list[int], rounds: int) -> list[dict]:
    shape = SHAPES[name]
    H, E, k = shape["hidden"], shape["experts"], shape["top_k"]
    g = torch.Generator().manual_seed(0)
    packed = (random_packed(E, 2 * shape["intermediate"], H, g),
              random_packed(E, H, shape["intermediate"], g))
    os.environ["KVRELAY_MOE_KERNEL"] = "auto"
    torch.set_num_threads(1)
    rows = []
    for storage in ("mxfp4", "dense"):
        ex = make_layer(shape, storage, torch.bfloat16, packed, seed=1).experts
        for T in tokens:
            x = torch.randn(T, H, generator=g).bfloat16()
            weights, ids = torch.softmax(torch.randn(T, k, generator=g), -1), \
                torch.randint(0, E, (T, k), generator=g)
            gu, dn = ex._kernel_weight(ex.gate_up), ex._kernel_weight(ex.down)
            args = (ex.first_expert, gu[0], gu[1], ex._f32("gate_up_bias"), dn[0], dn[1],
                    ex._f32("down_bias"), ex.alpha, ex.limit, "")
            op = torch.ops.kvrelay_kernels.moe_experts.default
            calls = {
                "forward + all_reduce": (_forward_all_reduce, (ex, x, weights, ids)),
                "decode": (ex.forward, (x, weights, ids)),
                "bare op": (op, (x, weights, ids, *args)),
            }
            best = {label: float("inf") for label in calls}
            for _ in range(rounds):
                for label, (call, call_args) in calls.items():
                    for _ in range(100):
                        call(*call_args)
                    start = time.thread_time()
                    for _ in range(2000):
                        call(*call_args)
                    best[label] = min(best[label], (time.thread_time() - start) / 2000 * 1e6)
            row = {"shape": name, "experts": "bf16" if storage == "dense" else storage,
                   "tokens": T, "us_per_call": {lb: round(v, 2) for lb, v in best.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
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



def _save(out_arg: str, default_out: str, default_name: str, info: dict, rows: list) -> None:
    """Rows + machine info as JSON; the default --out is renamed for this mode."""
    info["loadavg_after"] = os.getloadavg()
    out = Path(out_arg)
    if out_arg == default_out:
        out = out.with_name(default_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,20b")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    ap.add_argument("--threads", default="2",
                    help="intra-op thread counts, timed alternately (e.g. 1,2: the kernels' "
                         "OpenMP split against one thread; the decode mode takes the first)")
    ap.add_argument("--slow", type=float, default=5.0,
                    help="a variant whose warm-up call takes longer (s) is timed once")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe_kernels.json"))
    ap.add_argument("--decode", action="store_true", help="end-to-end LLM.generate instead")
    ap.add_argument("--kernel", action="store_true",
                    help="the expert kernel alone: GB/s of expert weights per call")
    ap.add_argument("--overhead", action="store_true",
                    help="per-call cost of the decode experts call outside the kernel")
    ap.add_argument("--isas", default="",
                    help="--kernel: ISA builds to time (default: every one this CPU runs "
                         "but generic)")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    torch.set_num_threads(threads[0])
    info = machine()
    print(json.dumps(info), flush=True)
    if args.decode:
        rows = run_decode(args.rounds)
        info["loadavg_after"] = os.getloadavg()
        out = Path(args.out).with_name("moe_kernels_decode.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.overhead:
        configs = "peers" if args.configs == ap.get_default("configs") else args.configs
        rows = [r for name in configs.split(",") for r in run_overhead(name, tokens, args.rounds)]
        _save(args.out, ap.get_default("out"), "moe_kernels_overhead.json", info, rows)
        return
    if args.kernel:
        isas = args.isas.split(",") if args.isas else \
            [i for i in kernels.status().isas if i != "generic"] or ["generic"]
        rows = []
        for name in args.configs.split(","):
            rows += run_kernel(name, tokens, args.rounds, threads, isas)
        _save(args.out, ap.get_default("out"), "moe_kernels_stream.json", info, rows)
        return
    variants = args.variants.split(",")
    rows = []
    for name in args.configs.split(","):
        chosen = [v for v in variants if not (name == "20b" and v.startswith("fp32"))] \
            if args.variants == ap.get_default("variants") else variants
        rows += run_shape(name, tokens, args.rounds, chosen, threads, args.slow)
    info["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
