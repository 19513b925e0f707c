#!/usr/bin/env python
"""Model-forward benchmark: kvrelay (bf16 / MXFP4 experts) against transformers.

Run by hand (this is not a pytest test):

    python benchmarks/model_forward.py [--quick] [--out results.json] [--no-profile]
                                       [--no-check] [--hf-experts eager]

What it does, in one run:

1. Builds a random gpt-oss-shaped checkpoint (tests/factories.py) scaled down to a
   small CPU: head_dim 64, GQA 8:1, sliding window 128 on even layers, YaRN, top-4 of
   32 experts, hidden != intermediate. The experts are written in the official MXFP4
   layout, so all three models below run on *the same* weights (MXFP4 values):
     - kvrelay, bf16 experts   load_model(..., quantization=None)   (dequantised at load)
     - kvrelay, MXFP4 experts  load_model(..., quantization="auto") (packed in memory)
     - transformers            GptOssForCausalLM.from_pretrained(..., Mxfp4Config(dequantize=True),
                               dtype=bf16, attn_implementation="eager")
   The checkpoint is cached in a temp directory keyed by the config.
2. Times prefill (one 256-token prompt; 4 x 64 tokens) and single-token decode steps
   at batch 1, 16 and 64 over a 192-token context, interleaving the models round by
   round, and reports medians. The machine may be shared: each sample records how much
   CPU other processes used meanwhile, contended rounds are repeated and each model
   keeps its least-contended samples (`Contention`).
   kvrelay steps go through `PagedGreedyLoop.step`, transformers through
   `model(input_ids, use_cache=True[, cache=...])`; both return logits for every fed
   token. The decode context is a KV cache filled with random values (attention cost
   does not depend on the values), so no long prefill is needed to set it up.
3. Profiles kvrelay's batch-64 decode step (a wall-time breakdown per part of the forward,
   each part's method wrapped on its instance, and torch.profiler's top operators).
4. Checks kvrelay against transformers in fp32 on a 64-token prompt (bf16 logits of
   these random weights are too chaotic to compare).
5. Prints a table and writes JSON with the machine, versions, config and all samples.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# -- configuration -----------------------------------------------------------------------

# gpt-oss-20b: hidden 2880, intermediate 2880, 24 layers, 32 experts top-4, 64/8 heads of
# 64, window 128, vocab 201088. Scaled so a full run takes a few minutes on 2 shared CPU
# cores without native bf16 matmuls (~16 GFLOP/s in bf16 there). The vocab is cut with
# the width: at 16000 the LM head is ~22% of the per-token weights read, vs ~16% for
# gpt-oss-20b (at 32000 it would be ~37% and dominate the comparison).
FULL_CONFIG: dict[str, Any] = {
    "vocab_size": 16000, "hidden_size": 512, "intermediate_size": 384, "head_dim": 64,
    "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 8,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "max_position_embeddings": 4096,
}
QUICK_CONFIG: dict[str, Any] = FULL_CONFIG | {
    "vocab_size": 8000, "hidden_size": 256, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_local_experts": 8,
}

# prefill: (batch, prompt length); decode: batch -> timed steps, over `context` tokens
FULL_WORKLOAD: dict[str, Any] = {
    "prefill": [(1, 256), (4, 64)], "prefill_reps": 3, "warmup": 1,
    "decode_reps": {1: 7, 16: 5, 64: 3}, "decode_warmup": 1, "context": 192,
    "profile_steps": 2, "extra_rounds": 4,
}
QUICK_WORKLOAD: dict[str, Any] = {
    "prefill": [(1, 128), (2, 64)], "prefill_reps": 2, "warmup": 1,
    "decode_reps": {1: 3, 8: 3}, "decode_warmup": 1, "context": 160,
    "profile_steps": 1, "extra_rounds": 2,
}

BLOCK_SIZE = 16
MODELS = ("kvrelay-bf16", "kvrelay-mxfp4", "transformers-bf16")
REFERENCE = "transformers-bf16"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- machine -------------------------------------------------------------------------------

def machine_info() -> dict[str, Any]:
    import transformers
    cpu = "unknown"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return {
        "cpu_model": cpu, "cpu_flags_simd": sorted(simd),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(), "mem_total_gib": mem,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


# -- checkpoint and models ----------------------------------------------------------------

def build_checkpoint(config: dict[str, Any], ckpt_dir: Path | None) -> Path:
    from tests.factories import make_hf_model, save_checkpoint
    key = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    path = ckpt_dir or Path(tempfile.gettempdir()) / f"kvrelay-bench-{key}"
    done = path / ".complete"
    if done.is_file():
        log(f"checkpoint: reusing {path}")
        return path
    log(f"checkpoint: building a random MXFP4 checkpoint in {path} ...")
    t0 = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    hf = make_hf_model(seed=0, **config)
    save_checkpoint(hf, path, mxfp4_experts=True)
    del hf
    gc.collect()
    done.write_text(key)
    log(f"checkpoint: done in {time.perf_counter() - t0:.0f} s")
    return path


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class KvrelayRunner:
    """kvrelay's model driven through PagedGreedyLoop (one loop, blocks reused)."""

    def __init__(self, path: Path, quantization: str | None, num_blocks: int) -> None:
        from kvrelay.model.generate import PagedGreedyLoop
        from kvrelay.model.loader import load_model
        self.loaded = load_model(path, dtype=torch.bfloat16, quantization=quantization,
                                 progress=False)
        self.model = self.loaded.model
        self.loop = PagedGreedyLoop(self.model, num_blocks, BLOCK_SIZE)
        gen = torch.Generator().manual_seed(1)
        for kv in self.loop.kv_caches:      # "context" KV for decode: random, as from a prefill
            kv.copy_(torch.randn(kv.shape, generator=gen))

    @property
    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes

    def _free(self, seqs) -> None:
        for s in seqs:
            self.loop.free.extend(s.blocks)
            s.blocks = []

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        from kvrelay.model.generate import _Seq
        seqs = [_Seq(list(p)) for p in prompts]
        try:
            return self.loop.step(seqs, [len(p) for p in prompts])
        finally:
            self._free(seqs)

    def decode_setup(self, batch: int, context: int, vocab: int, steps: int) -> Any:
        from kvrelay.model.generate import _Seq
        gen = torch.Generator().manual_seed(batch)
        seqs = []
        need = -(-(context + steps) // BLOCK_SIZE)
        for _ in range(batch):
            s = _Seq(torch.randint(0, vocab, (context,), generator=gen).tolist())
            s.blocks = [self.loop.free.pop() for _ in range(need)]
            s.computed = context
            seqs.append(s)
        return {"seqs": seqs, "gen": gen, "vocab": vocab}

    def decode_step(self, state: Any) -> torch.Tensor:
        seqs = state["seqs"]
        new = torch.randint(0, state["vocab"], (len(seqs),), generator=state["gen"]).tolist()
        for s, t in zip(seqs, new):
            s.tokens.append(t)
        return self.loop.step(seqs, [1] * len(seqs))

    def decode_teardown(self, state: Any) -> None:
        self._free(state["seqs"])


class TransformersRunner:
    """transformers' GptOssForCausalLM, bf16, eager attention, DynamicCache."""

    def __init__(self, path: Path, experts_implementation: str | None = None) -> None:
        from transformers import GptOssForCausalLM, Mxfp4Config
        extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
        self.model = GptOssForCausalLM.from_pretrained(
            path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16,
            attn_implementation="eager", **extra).eval()
        self.experts_implementation = self.model.config._experts_implementation
        self.attn_implementation = self.model.config._attn_implementation

    @property
    def weight_bytes(self) -> int:
        return param_bytes(self.model)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor(prompts), use_cache=True)
        return out.logits.flatten(0, 1)

    def decode_setup(self, batch: int, context: int, vocab: int, steps: int) -> Any:
        from transformers import DynamicCache
        c = self.model.config
        cache = DynamicCache(config=c)
        gen = torch.Generator().manual_seed(batch)
        shape = (batch, c.num_key_value_heads, context, c.head_dim)
        for i in range(c.num_hidden_layers):
            k = torch.randn(shape, generator=gen).to(torch.bfloat16)
            v = torch.randn(shape, generator=gen).to(torch.bfloat16)
            cache.update(k, v, i)
        return {"cache": cache, "gen": gen, "vocab": vocab, "batch": batch}

    @torch.no_grad()
    def decode_step(self, state: Any) -> torch.Tensor:
        ids = torch.randint(0, state["vocab"], (state["batch"], 1), generator=state["gen"])
        out = self.model(input_ids=ids, cache=state["cache"], use_cache=True)
        state["cache"] = out.cache
        return out.logits.flatten(0, 1)

    def decode_teardown(self, state: Any) -> None:
        state.clear()


# -- timing ---------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Contention:
    """How much of the machine *other* processes used during a stretch of time.

    /proc/stat's busy jiffies minus this process's own (/proc/self/stat), as a fraction
    of all CPUs. On a shared 2-core machine a neighbour busy for a few seconds stalls
    2-thread OpenMP regions and inflates a sample several-fold, so each sample records
    the share others used while it ran; rounds are repeated (up to `extra` more) until
    every model has enough samples under `threshold`, and each model keeps its
    least-contended ones. `wait_quiet` waits (within a total budget) for a quiet second
    before each round."""

    def __init__(self, threshold: float = 0.25, max_wait_s: float = 240.0) -> None:
        self.threshold, self.wait_budget = threshold, max_wait_s
        self.waited_s = 0.0
        self.available = Path("/proc/stat").is_file() and Path("/proc/self/stat").is_file()

    @staticmethod
    def snapshot() -> tuple[int, int, int]:
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy, total = sum(cpu) - cpu[3] - cpu[4], sum(cpu)       # minus idle and iowait
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ours = int(fields[11]) + int(fields[12])                 # utime + stime
        return busy, total, ours

    def others(self, a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
        if b[1] <= a[1]:
            return 0.0
        return max(0.0, ((b[0] - a[0]) - (b[2] - a[2])) / (b[1] - a[1]))

    def wait_quiet(self) -> None:
        if not self.available:
            return
        while self.waited_s < self.wait_budget:
            a = self.snapshot()
            time.sleep(1.0)
            if self.others(a, self.snapshot()) <= self.threshold:
                return
            self.waited_s += 1.0

    def measure(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(seconds, others' share of the CPUs) for one call; the share's denominator is at
        least 20 jiffies so a short sample is not condemned by a single tick."""
        if not self.available:
            return timed(fn), 0.0
        a = self.snapshot()
        seconds = timed(fn)
        b = self.snapshot()
        used = (b[0] - a[0]) - (b[2] - a[2])
        return seconds, max(0.0, used / max(b[1] - a[1], 20))

    def rounds(self, reps: int, extra: int, fns: dict[str, Callable[[], Any]]
               ) -> tuple[dict[str, list[tuple[float, float]]], int]:
        """Rounds of one call per model (interleaved A B C, A B C, ...) until every model
        has `reps` quiet samples, at most reps + extra rounds. Returns, per model, its
        `reps` least-contended (seconds, share) samples in run order, and rounds run."""
        done: dict[str, list[tuple[float, float, int]]] = {name: [] for name in fns}
        rounds = 0
        while rounds < reps + extra:
            self.wait_quiet()
            for name, fn in fns.items():
                seconds, share = self.measure(fn)
                done[name].append((seconds, share, rounds))
            rounds += 1
            if all(sum(sh <= self.threshold for _, sh, _ in d) >= reps for d in done.values()):
                break
        kept = {}
        for name, d in done.items():
            best = sorted(d, key=lambda x: (x[1] > self.threshold, x[1], x[2]))[:reps]
            kept[name] = [(sec, round(sh, 3)) for sec, sh, _ in sorted(best, key=lambda x: x[2])]
        return kept, rounds


def summarize(kept: list[tuple[float, float]], rounds: int) -> dict[str, Any]:
    samples, contention = [k[0] for k in kept], [k[1] for k in kept]
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples_s": [round(s, 5) for s in samples],
            "others_cpu_frac": contention, "rounds_run": rounds,
            "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def _report(rec: dict[str, Any], counter: list[int], total: int) -> None:
    counter[0] += 1
    n = len(rec["samples_s"])
    log(f"[{counter[0]:2d}/{total}] {rec['workload']:<16} {rec['model']:<18} "
        f"{rec['median_s'] * 1e3:9.1f} ms  {rec['tokens_per_s']:8.1f} tok/s  (median of {n}"
        f" of {rec['rounds_run']} rounds; min {rec['min_s'] * 1e3:.1f} ms; others' CPU "
        f"{max(rec['others_cpu_frac'], default=0):.0%} max)")


def run_prefill(runners: dict[str, Any], batch: int, length: int, vocab: int,
                wl: dict[str, Any], cont: Contention, results: list[dict],
                counter: list[int], total: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + batch * length)
    prompts = torch.randint(0, vocab, (batch, length), generator=gen).tolist()
    first: dict[str, torch.Tensor] = {}
    for name, r in runners.items():
        for i in range(wl["warmup"]):
            out = r.prefill(prompts)
            if i == 0:
                first[name] = out.float()

    fns = {name: (lambda r=r: r.prefill(prompts)) for name, r in runners.items()}
    kept, n = cont.rounds(wl["prefill_reps"], wl["extra_rounds"], fns)
    for name in runners:
        s = summarize(kept[name], n)
        tokens = batch * length
        rec = {"kind": "prefill", "workload": f"prefill {batch}x{length}", "batch": batch,
               "prompt_len": length, "tokens": tokens, "model": name,
               "tokens_per_s": tokens / s["median_s"], **s}
        results.append(rec)
        _report(rec, counter, total)
    return first


def run_decode(runners: dict[str, Any], batch: int, context: int, vocab: int,
               wl: dict[str, Any], cont: Contention, results: list[dict],
               counter: list[int], total: int) -> None:
    reps = wl["decode_reps"][batch]
    steps = wl["decode_warmup"] + reps + wl["extra_rounds"] + 1
    states = {name: r.decode_setup(batch, context, vocab, steps) for name, r in runners.items()}
    for name, r in runners.items():
        for _ in range(wl["decode_warmup"]):
            r.decode_step(states[name])

    fns = {name: (lambda r=r, st=states[name]: r.decode_step(st))
           for name, r in runners.items()}
    kept, n = cont.rounds(reps, wl["extra_rounds"], fns)
    for name, r in runners.items():
        r.decode_teardown(states[name])
        s = summarize(kept[name], n)
        rec = {"kind": "decode", "workload": f"decode b={batch}", "batch": batch,
               "context": context, "model": name, "step_ms": s["median_s"] * 1e3,
               "tokens_per_s": batch / s["median_s"], **s}
        results.append(rec)
        _report(rec, counter, total)


# -- profiling --------------------------------------------------------------------------------

# The forward's parts, by attribute path (in a decoder layer, or "" for the model) and method.
# `DecoderLayer.forward` calls its submodules' methods directly (`.forward`, `qk_v`,
# `rope_attend`, `add_forward`, `route_forward`), which forward hooks never see, so each
# method is wrapped on its instance, as step_profile.py --parts does. A part running inside
# another (`rotate` and the attention inside an unfused `rope_attend`) is not counted again.
LAYER_PARTS = {
    ("input_layernorm", "forward"): "rmsnorm (+ residual add)",
    ("input_layernorm", "add_forward"): "rmsnorm (+ residual add)",
    ("self_attn.qkv", "qk_v"): "attn: qkv proj",
    ("self_attn.attn", "rope_attend"): "attn: rotary + paged attention (+KV write)",
    ("self_attn.o_proj", "forward"): "attn: o proj",
    ("post_attention_layernorm", "add_forward"): "rmsnorm (+ residual add)",
    ("mlp.experts", "route_forward"): "moe: router + experts",
}
MODEL_PARTS = {
    ("embed_tokens", "forward"): "embedding",
    ("norm", "forward"): "rmsnorm (+ residual add)",
    ("norm", "add_forward"): "rmsnorm (+ residual add)",
    ("lm_head", "logits"): "lm_head (all fed tokens)",
}
TOTAL = "model forward (total)"


class PartTimer:
    """Wall time per named part, summed over calls: methods wrapped on their instances
    (`wrap`; an instance attribute shadows the class's method, for `module(x)` and
    `module.forward(x)` alike) until `restore` deletes the wrappers again."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.depth = 0                    # parts running now (only the outermost is counted)
        self.wrapped: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}

    def wrap(self, module: torch.nn.Module, method: str, name: str, part: bool = True) -> None:
        """Time `module.method` as `name`; `part=False`: always (a total around parts)."""
        if not hasattr(module, method) or (id(module), method) in self.wrapped:
            return
        fn, nested = getattr(module, method), int(part)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if part and self.depth:
                return fn(*args, **kwargs)
            self.depth += nested
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[name] += time.perf_counter() - t0
                self.depth -= nested
        setattr(module, method, timed_call)
        self.wrapped[(id(module), method)] = (module, method)

    def wrap_model(self, model: torch.nn.Module) -> None:
        self.wrap(model, "forward", TOTAL, part=False)
        for (path, method), name in MODEL_PARTS.items():
            self.wrap(model.get_submodule(path), method, name)
        for layer in model.layers:
            for (path, method), name in LAYER_PARTS.items():
                self.wrap(layer.get_submodule(path), method, name)

    def restore(self) -> None:
        for module, method in self.wrapped.values():
            delattr(module, method)
        self.wrapped.clear()


def module_breakdown(runner: KvrelayRunner, batch: int, context: int, vocab: int,
                     steps: int) -> dict[str, Any]:
    """Wall time per part of the forward (`PartTimer`) over `steps` decode steps. The
    layers run one by one here: the plan's `decode_stack` (all layers in one native call,
    which has no parts to time) is off for the breakdown, so its step_ms can exceed the
    timed rounds' where the stack runs."""
    import dataclasses

    from kvrelay.model import mxfp4 as mx
    model = runner.model
    plan = model.plan
    parts = PartTimer()
    orig_expert = mx.MXFP4Tensor.expert

    def timed_expert(self, e, dtype):
        t0 = time.perf_counter()
        try:
            return orig_expert(self, e, dtype)
        finally:
            parts.acc["moe: router + experts > MXFP4 dequantise"] += time.perf_counter() - t0
    state = runner.decode_setup(batch, context, vocab, steps + 2)
    model.use_plan(dataclasses.replace(plan, decode_stack=False))
    parts.wrap_model(model)
    mx.MXFP4Tensor.expert = timed_expert
    try:
        runner.decode_step(state)                           # warm-up
        parts.acc.clear()
        total = 0.0
        for _ in range(steps):
            total += timed(lambda: runner.decode_step(state))
    finally:
        mx.MXFP4Tensor.expert = orig_expert
        parts.restore()
        model.use_plan(plan)
        runner.decode_teardown(state)
    per_step = {k: v / steps * 1e3 for k, v in parts.acc.items()}
    step_ms = total / steps * 1e3
    model_ms = per_step.pop(TOTAL, 0.0)
    head_ms = per_step.get("lm_head (all fed tokens)", 0.0)
    inner = sum(v for k, v in per_step.items() if ">" not in k) - head_ms
    per_step["other inside model (Python glue)"] = model_ms - inner
    per_step["outside model (PagedGreedyLoop metadata, logits .float())"] = (
        step_ms - model_ms - head_ms)
    rows = sorted(per_step.items(), key=lambda kv: -kv[1])
    return {"step_ms": step_ms, "decode_stack_off": plan.decode_stack,
            "modules_ms": {k: round(v, 2) for k, v in rows},
            "modules_pct": {k: round(100 * v / step_ms, 1) for k, v in rows}}


def op_profile(runner: KvrelayRunner, batch: int, context: int, vocab: int,
               steps: int, top: int = 12) -> list[dict[str, Any]]:
    """torch.profiler's operators by self CPU time over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile
    state = runner.decode_setup(batch, context, vocab, steps + 2)
    try:
        runner.decode_step(state)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.decode_step(state)
    finally:
        runner.decode_teardown(state)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "calls_per_step": e.count / steps,
                 "self_ms_per_step": round(e.self_cpu_time_total / steps / 1e3, 2),
                 "self_pct": round(100 * e.self_cpu_time_total / total, 1)} for e in rows]


# -- report ---------------------------------------------------------------------------------

def add_ratios(results: list[dict]) -> None:
    ref = {r["workload"]: r for r in results if r["model"] == REFERENCE}
    for r in results:
        base = ref.get(r["workload"])
        if base:
            # >1: kvrelay faster (throughput ratio == inverse time ratio)
            r["speed_vs_transformers"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["time_vs_transformers"] = r["median_s"] / base["median_s"]


def table(results: list[dict], weight_bytes: dict[str, int]) -> str:
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    by = {(r["workload"], r["model"]): r for r in results}
    head = ["workload"] + [f"{m}" for m in MODELS] + [f"{m} / {REFERENCE} (speed)" for m in MODELS
                                                      if m != REFERENCE]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        cells = [w]
        for m in MODELS:
            r = by.get((w, m))
            if r is None:
                cells.append("-")
            elif r["kind"] == "prefill":
                cells.append(f"{r['tokens_per_s']:.0f} tok/s ({r['median_s'] * 1e3:.0f} ms)")
            else:
                cells.append(f"{r['step_ms']:.1f} ms ({r['tokens_per_s']:.0f} tok/s)")
        for m in MODELS:
            if m != REFERENCE:
                r = by.get((w, m))
                ok = r is not None and "speed_vs_transformers" in r
                cells.append(f"{r['speed_vs_transformers']:.2f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["weights"] + [f"{weight_bytes[m] / 2**20:.0f} MiB" for m in MODELS] + \
        [f"{weight_bytes[m] / weight_bytes[REFERENCE]:.2f}x size" for m in MODELS if m != REFERENCE]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    same = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"max_abs_diff": round((ours - ref).abs().max().item(), 4),
            "ref_max_abs": round(ref.abs().max().item(), 4),
            "argmax_agreement": round(same, 4)}


def agreement(first: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How close the timed models' prefill logits are (same weights, all bf16).

    With these random weights bf16 rounding alone changes most argmaxes (transformers
    bf16 vs transformers fp32 disagrees as much), so only the fp32 check below says
    whether the models compute the same function."""
    ref = first[REFERENCE]
    out = {f"{n} vs {REFERENCE} (bf16)": _compare(x, ref)
           for n, x in first.items() if n != REFERENCE}
    out["kvrelay-mxfp4 vs kvrelay-bf16 (bf16)"] = _compare(first["kvrelay-mxfp4"],
                                                           first["kvrelay-bf16"])
    return out


def fp32_check(path: Path, vocab: int, length: int = 64) -> dict[str, Any]:
    """kvrelay vs transformers in float32 on one prompt: the correctness sanity check."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    from kvrelay.model.generate import PagedGreedyLoop, _Seq
    from kvrelay.model.loader import load_model
    prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(7)).tolist()
    model = load_model(path, dtype=torch.float32, quantization=None, progress=False).model
    loop = PagedGreedyLoop(model, -(-length // BLOCK_SIZE), BLOCK_SIZE)
    ours = loop.step([_Seq(prompt)], [length])
    del model
    hf = GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    return dict(prompt_len=length, **_compare(ours, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny config and workload (smoke test)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write results as JSON here (default: benchmarks/results/"
                         "model_forward[_quick].json)")
    ap.add_argument("--ckpt-dir", type=Path, default=None,
                    help="where to build/reuse the random checkpoint (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy-threshold", type=float, default=0.25,
                    help="repeat a round when other processes used more than this fraction "
                         "of all CPUs during it (default 0.25)")
    ap.add_argument("--max-wait", type=float, default=240.0,
                    help="total seconds to wait for a quiet machine before rounds")
    ap.add_argument("--hf-experts", default=None,
                    help="transformers experts_implementation (default: its own default, "
                         "grouped_mm where available; 'eager' is the per-expert loop)")
    ap.add_argument("--no-profile", action="store_true", help="skip the batch-64 decode profile")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 correctness check")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = QUICK_CONFIG if args.quick else FULL_CONFIG
    wl = QUICK_WORKLOAD if args.quick else FULL_WORKLOAD
    t_start = time.perf_counter()
    info = machine_info()
    info["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    log(f"machine: {info['cpu_model']}, {info['usable_cpus']} usable CPUs, "
        f"torch {info['torch']} ({info['torch_threads']} threads), "
        f"transformers {info['transformers']}")

    path = build_checkpoint(config, args.ckpt_dir)
    max_batch = max(list(wl["decode_reps"]) + [b for b, _ in wl["prefill"]])
    steps = wl["decode_warmup"] + max(wl["decode_reps"].values()) + wl["extra_rounds"] + 4
    max_len = max([wl["context"] + steps] + [n for _, n in wl["prefill"]])
    num_blocks = max_batch * -(-max_len // BLOCK_SIZE) + 8
    log("loading models ...")
    runners: dict[str, Any] = {
        "kvrelay-bf16": KvrelayRunner(path, None, num_blocks),
        "kvrelay-mxfp4": KvrelayRunner(path, "auto", num_blocks),
        "transformers-bf16": TransformersRunner(path, args.hf_experts),
    }
    hf: TransformersRunner = runners[REFERENCE]
    hf_experts, hf_attn = hf.experts_implementation, hf.attn_implementation
    assert runners["kvrelay-mxfp4"].model.mxfp4 and not runners["kvrelay-bf16"].model.mxfp4
    weight_bytes = {name: r.weight_bytes for name, r in runners.items()}
    log("weights: " + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in weight_bytes.items())
        + f"; transformers experts implementation {hf.experts_implementation!r}, "
          f"attention {hf.attn_implementation!r}")

    cont = Contention(args.busy_threshold, args.max_wait)
    results: list[dict] = []
    total = len(MODELS) * (len(wl["prefill"]) + len(list(wl["decode_reps"])))
    counter = [0]
    vocab = config["vocab_size"]
    agree = None
    for batch, length in wl["prefill"]:
        first = run_prefill(runners, batch, length, vocab, wl, cont, results, counter, total)
        if agree is None:
            agree = agreement(first)
            log(f"logit agreement (prefill {batch}x{length}): {agree}")
    for batch in list(wl["decode_reps"]):
        run_decode(runners, batch, wl["context"], vocab, wl, cont, results, counter, total)
    add_ratios(results)

    profile: dict[str, Any] = {}
    if not args.no_profile:
        pb = max(list(wl["decode_reps"]))
        for name in ("kvrelay-bf16", "kvrelay-mxfp4"):
            for attempt in range(3):                        # again if a neighbour got busy
                log(f"profiling {name} decode b={pb} ...")
                cont.wait_quiet()
                a = cont.snapshot() if cont.available else None
                profile[name] = {
                    "batch": pb, "context": wl["context"],
                    "breakdown": module_breakdown(runners[name], pb, wl["context"], vocab,
                                                  steps=wl["profile_steps"]),
                    "top_ops": op_profile(runners[name], pb, wl["context"], vocab, steps=1)}
                frac = cont.others(a, cont.snapshot()) if a else 0.0
                profile[name] |= {"others_cpu_frac": round(frac, 3), "attempts": attempt + 1}
                if frac <= args.busy_threshold:
                    break

    check = None
    if not args.no_check:
        del runners, hf
        gc.collect()
        log("fp32 correctness check (kvrelay vs transformers, 64-token prompt) ...")
        check = fp32_check(path, vocab)
        log(f"fp32 check: {check}")

    print()
    print(f"config: {json.dumps(config)}")
    print(f"transformers: experts_implementation={hf_experts!r}, attn_implementation={hf_attn!r}")
    print()
    print(table(results, weight_bytes))
    print("\nspeed ratio = kvrelay throughput / transformers throughput (>1: kvrelay faster)")
    if agree:
        print(f"\nlogit agreement, timed bf16 prefill: {json.dumps(agree)}")
    if check:
        print(f"fp32 check, kvrelay vs transformers: {json.dumps(check)}")
    for name, p in profile.items():
        print(f"\n{name} decode b={p['batch']} ctx={p['context']}: "
              f"{p['breakdown']['step_ms']:.1f} ms/step")
        for k, v in p["breakdown"]["modules_ms"].items():
            print(f"  {v:9.2f} ms  {p['breakdown']['modules_pct'][k]:5.1f}%  {k}")
        print("  top ops (self CPU):")
        for row in p["top_ops"]:
            print(f"  {row['self_ms_per_step']:9.2f} ms  {row['self_pct']:5.1f}%  "
                  f"{row['calls_per_step']:7.0f} calls  {row['op']}")
    elapsed = time.perf_counter() - t_start
    info["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at start {info['loadavg_at_start']}, at end {info['loadavg_at_end']} "
          f"({info['usable_cpus']} CPUs)")
    print(f"\ntotal wall time {elapsed:.0f} s")

    out = args.out or ROOT / "benchmarks" / "results" / (
        "model_forward_quick.json" if args.quick else "model_forward.json")
    payload = {
        "benchmark": "model_forward", "date": time.strftime("%Y-%m-%d"), "quick": args.quick,
        "machine": info, "config": config, "workload": wl, "block_size": BLOCK_SIZE,
        "transformers_experts_implementation": hf_experts,
        "transformers_attn_implementation": hf_attn,
        "weight_bytes": weight_bytes, "logit_agreement_bf16": agree, "fp32_check": check,
        "busy_threshold": args.busy_threshold, "waited_for_quiet_s": cont.waited_s,
        "results": results,
        "profile": profile, "wall_time_s": round(elapsed, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
