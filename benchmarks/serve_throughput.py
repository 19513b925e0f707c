#!/usr/bin/env python
"""Served throughput: `kvrelay serve` vs `vllm serve`, driven by vLLM's own client.

Run by hand (this is not a pytest test), from the kvrelay venv:

    python benchmarks/serve_throughput.py [--quick] [--models tiny,embedded]
        [--engines kvrelay,vllm] [--concurrency 1,8,64] [--out DIR]

For each model (the tiny bf16 gpt-oss checkpoint of offline_throughput.py, and kvrelay's
embedded SmolLM2-135M-as-gpt-oss, float32 on disk) and each engine, one server at a time
on 127.0.0.1 and a free port:

    kvrelay serve PATH --port P --dtype bfloat16 --max-num-seqs 64 --max-model-len 512
    vllm serve PATH --port P --dtype bfloat16 --max-num-seqs 64 --max-model-len 512

(both also get --host 127.0.0.1 --served-model-name bench), then for each concurrency:

    vllm bench serve --backend vllm --base-url http://127.0.0.1:P --model bench
        --tokenizer PATH --dataset-name random --random-input-len 128 --random-output-len 64
        --num-prompts 64 --max-concurrency C --ignore-eos --seed 0 --save-result ...

Each server is stopped by its PID (SIGTERM to its process group, SIGKILL after 30 s)
whatever happens. kvrelay's offline engine then runs the same workload (64 requests of
128 random prompt tokens, 64 output tokens, all at once, with the server's settings) so
served/offline output tok/s can be reported (target: >= 90% at 64 streams).

Threads: OMP_NUM_THREADS=2 for kvrelay (its engine-core process), and
VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 for vLLM.
If `vllm bench serve` is missing, --client httpx uses a small built-in async client that
reports the same metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
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
    loadavg,
    log,
    machine_info,
    wait_for_quiet,
)

VLLM_BIN = str(Path(VLLM_PYTHON).parent / "vllm")
SERVER_FLAGS = ["--dtype", "bfloat16", "--max-num-seqs", "64", "--max-model-len", "512"]
METRICS = ("output_throughput", "request_throughput", "total_token_throughput", "duration",
           "completed", "total_input_tokens", "total_output_tokens",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
           "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms",
           "median_e2el_ms")


def vllm_env() -> dict[str, str]:
    return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{THREADS - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_dir() -> Path:
    from kvrelay.model.embedded import embedded_model_dir
    return Path(embedded_model_dir())


# -- servers ------------------------------------------------------------------------------
class Server:
    """One server process in its own process group; always stopped by PID."""

    def __init__(self, engine: str, path: Path, log_path: Path) -> None:
        self.engine, self.port = engine, free_port()
        flags = ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench",
                 *SERVER_FLAGS]
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
        if engine == "kvrelay":
            cmd = [sys.executable, "-m", "kvrelay.cli", "serve", str(path), *flags]
        else:
            cmd = [VLLM_BIN, "serve", str(path), *flags]
            env |= vllm_env()
        self.cmd = cmd
        self.log_file = open(log_path, "w")  # noqa: SIM115 -- closed by stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(ROOT), start_new_session=True)
        self.pid = self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 900) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited {self.proc.returncode} "
                                   "before ready")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.engine} server not ready after {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        else:   # the leader is gone; make sure no child of its group survives
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log_file.close()


# -- clients ------------------------------------------------------------------------------
def run_vllm_bench(url: str, tokenizer: Path, concurrency: int, num_prompts: int, input_len: int,
                   output_len: int, result_dir: Path, name: str,
                   timeout_s: float) -> dict[str, Any]:
    cmd = [VLLM_BIN, "bench", "serve", "--backend", "vllm", "--base-url", url, "--model", "bench",
           "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--seed", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_dir),
           "--result-filename", f"{name}.json"]
    env = dict(os.environ) | vllm_env()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    (result_dir / f"{name}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {r.returncode}: {r.stderr.strip()[-400:]}")
    data = json.loads((result_dir / f"{name}.json").read_text())
    failed = data.get("failed", num_prompts - (data.get("completed") or 0))
    return {k: data.get(k) for k in METRICS} | {"failed": failed}


async def _httpx_bench(url: str, tokenizer: Path, concurrency: int, num_prompts: int,
                       input_len: int, output_len: int) -> dict[str, Any]:
    """Fallback client: streamed /v1/completions with token-id prompts, the same metrics
    as vllm bench serve (TTFT, TPOT = (e2e - ttft)/(out - 1), ITL, output tok/s)."""
    import httpx
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(tokenizer).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(concurrency)
    rows: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                "stream": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
        async with sem:
            t0 = time.perf_counter()
            times, out_tokens = [], 0
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        out_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        times.append(time.perf_counter())
            e2e = time.perf_counter() - t0
            ttft = times[0] - t0 if times else e2e
            rows.append({"ttft": ttft, "e2e": e2e, "out": out_tokens,
                         "itl": [b - a for a, b in itertools.pairwise(times)]})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    duration = time.perf_counter() - t0
    ttft = [r["ttft"] * 1e3 for r in rows]
    tpot = [(r["e2e"] - r["ttft"]) / (r["out"] - 1) * 1e3 for r in rows if r["out"] > 1]
    itl = [x * 1e3 for r in rows for x in r["itl"]]
    out = sum(r["out"] for r in rows)

    def p99(xs: list[float]) -> float | None:
        return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else None

    return {"output_throughput": out / duration, "request_throughput": len(rows) / duration,
            "duration": duration, "completed": len(rows), "total_output_tokens": out,
            "total_input_tokens": input_len * len(rows),
            "mean_ttft_ms": statistics.mean(ttft), "median_ttft_ms": statistics.median(ttft),
            "p99_ttft_ms": p99(ttft),
            "mean_tpot_ms": statistics.mean(tpot), "median_tpot_ms": statistics.median(tpot),
            "p99_tpot_ms": p99(tpot),
            "mean_itl_ms": statistics.mean(itl), "median_itl_ms": statistics.median(itl),
            "p99_itl_ms": p99(itl), "failed": num_prompts - len(rows)}


# -- kvrelay offline on the same workload -----------------------------------------------------
OFFLINE_WORKER = r"""
import json, random, sys, time, torch
torch.set_num_threads(int(sys.argv[5]))
from kvrelay import LLM, SamplingParams
path, n, lin, lout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, dtype="bfloat16", max_num_seqs=64, max_model_len=512)
vocab = llm.engine.model_config.vocab_size
rng = random.Random(0)
prompts = [[rng.randrange(10, vocab) for _ in range(lin)] for _ in range(n)]
params = SamplingParams(temperature=0, max_tokens=lout, ignore_eos=True)
llm.generate([p[:16] for p in prompts[:8]],
             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
runs = []
for _ in range(2):
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    runs.append({"seconds": dt, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)})
best = min(runs, key=lambda r: r["seconds"])
print(json.dumps({"runs": runs, "output_throughput": best["output_tokens"] / best["seconds"]}))
"""


def kvrelay_offline(path: Path, num: int, input_len: int, output_len: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-c", OFFLINE_WORKER, str(path), str(num), str(input_len),
                        str(output_len), str(THREADS)], env=env, capture_output=True, text=True,
                       cwd=str(ROOT), timeout=3600)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-400:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- main -----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny model only, 16 prompts, concurrency 1,8")
    ap.add_argument("--models", default="tiny,embedded")
    ap.add_argument("--engines", default="kvrelay,vllm")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--client", choices=("vllm", "httpx"), default="vllm")
    ap.add_argument("--max-wait", type=float, default=None,
                    help="seconds to wait for other processes to quieten before each server "
                         "(default 180; 0 with --quick)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.quick:
        args.models, args.concurrency, args.num_prompts = "tiny", "1,8", 16
    max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 180.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    client = args.client
    if client == "vllm" and not Path(VLLM_BIN).exists():
        log(f"{VLLM_BIN} not found: using the built-in httpx client")
        client = "httpx"
    engines = [e for e in args.engines.split(",") if e]
    if "vllm" in engines and not Path(VLLM_BIN).exists():
        engines.remove("vllm")
    concs = [int(c) for c in args.concurrency.split(",")]
    models = {}
    for m in args.models.split(","):
        if m == "tiny":
            models[m] = build_checkpoint("tiny" + ("-quick" if args.quick else ""),
                                         (QUICK_CONFIGS if args.quick else CONFIGS)["tiny"])
        elif m == "embedded":
            models[m] = embedded_dir()
        else:
            models[m] = Path(m)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine_info(), "client": client,
        "workload": {"dataset": "random", "input_len": args.input_len,
                     "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "concurrency": concs, "ignore_eos": True},
        "server_flags": SERVER_FLAGS + ["--host", "127.0.0.1", "--served-model-name", "bench"],
        "models": {k: str(v) for k, v in models.items()}, "results": {}}
    path_json = out_dir / ("serve_results_quick.json" if args.quick else "serve_results.json")

    for mname, path in models.items():
        res_m = results["results"].setdefault(mname, {})
        for engine in engines:
            quiet = wait_for_quiet(max_wait)
            log(f"{mname}/{engine}: starting server (others busy "
                f"{quiet['others_busy_cores_before']:.2f} cores)")
            server = Server(engine, path, work / f"{mname}-{engine}-server.log")
            entry: dict[str, Any] = {"cmd": " ".join(server.cmd), "pid": server.pid} | quiet
            try:
                entry["ready_s"] = server.wait_ready()
                for c in concs:
                    t0 = time.monotonic()
                    if client == "vllm":
                        r = run_vllm_bench(server.url, path, c, args.num_prompts, args.input_len,
                                           args.output_len, work, f"{mname}-{engine}-c{c}",
                                           timeout_s=3600)
                    else:
                        r = asyncio.run(_httpx_bench(server.url, path, c, args.num_prompts,
                                                     args.input_len, args.output_len))
                    r["loadavg_after"] = loadavg()
                    entry[f"c{c}"] = r
                    log(f"{mname}/{engine} c={c}: {r['output_throughput']:.1f} output tok/s, TTFT "
                        f"median {r['median_ttft_ms']:.0f} ms, TPOT median "
                        f"{r['median_tpot_ms']:.1f} ms ({time.monotonic() - t0:.0f} s)")
                    path_json.write_text(json.dumps(results | {"results": results["results"]},
                                                    indent=1))
            except Exception as e:                                 # noqa: BLE001
                entry["error"] = f"{type(e).__name__}: {e}"
                log(f"{mname}/{engine}: {entry['error']}")
                tail = (work / f"{mname}-{engine}-server.log").read_text()[-1500:]
                entry["server_log_tail"] = tail
            finally:
                server.stop()
                log(f"{mname}/{engine}: server pid {server.pid} stopped")
            res_m[engine] = entry
            path_json.write_text(json.dumps(results, indent=1))
        if "kvrelay" in engines:
            wait_for_quiet(max_wait)
            log(f"{mname}: kvrelay offline, {args.num_prompts} x {args.input_len} in / "
                f"{args.output_len} out")
            res_m["kvrelay_offline"] = kvrelay_offline(path, args.num_prompts, args.input_len,
                                                       args.output_len)
            path_json.write_text(json.dumps(results, indent=1))
        derive(res_m, concs)
        path_json.write_text(json.dumps(results, indent=1))
    report(results, concs)


def derive(res_m: dict[str, Any], concs: list[int]) -> None:
    d: dict[str, Any] = {}
    kv, vl, off = res_m.get("kvrelay", {}), res_m.get("vllm", {}), res_m.get("kvrelay_offline", {})
    for c in concs:
        k, v = kv.get(f"c{c}"), vl.get(f"c{c}")
        if k and v:
            d[f"c{c}_kvrelay_vs_vllm_output_tok_s"] = (k["output_throughput"]
                                                       / v["output_throughput"])
    top = max(concs)
    if kv.get(f"c{top}") and off.get("output_throughput"):
        ratio = kv[f"c{top}"]["output_throughput"] / off["output_throughput"]
        d["served_over_offline"] = {"concurrency": top, "value": ratio, "target": 0.9,
                                    "met": ratio >= 0.9}
    res_m["derived"] = d


def report(results: dict[str, Any], concs: list[int]) -> None:
    print(f"\nclient: {results['client']}; workload: {results['workload']}")
    for mname, res_m in results["results"].items():
        print(f"\n== {mname} ({results['models'][mname]}) ==")
        print(f"{'engine':8s} {'conc':>4s} {'out tok/s':>9s} {'TTFT mean':>9s} {'median':>8s} "
              f"{'p99':>8s} {'TPOT mean':>9s} {'median':>8s} {'p99':>8s}")
        for engine in ("kvrelay", "vllm"):
            e = res_m.get(engine)
            if not e:
                continue
            if "error" in e:
                print(f"{engine:8s} ERROR {e['error']}")
            for c in concs:
                r = e.get(f"c{c}")
                if r:
                    print(f"{engine:8s} {c:4d} {r['output_throughput']:9.1f} "
                          f"{r['mean_ttft_ms']:9.0f} {r['median_ttft_ms']:8.0f} "
                          f"{r['p99_ttft_ms']:8.0f} {r['mean_tpot_ms']:9.1f} "
                          f"{r['median_tpot_ms']:8.1f} {r['p99_tpot_ms']:8.1f}")
        off = res_m.get("kvrelay_offline", {})
        if off.get("output_throughput"):
            print(f"kvrelay offline ({results['workload']['num_prompts']} requests at once): "
                  f"{off['output_throughput']:.1f} output tok/s")
        for k, v in res_m.get("derived", {}).items():
            print(f"  {k}: {v if not isinstance(v, float) else f'{v:.2f}'}")


if __name__ == "__main__":
    main()
