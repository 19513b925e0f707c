"""Single instance vs 1P1D on the same 2 cores: does disaggregation protect decode?

    python benchmarks/disagg.py [--model DIR] [--base-port 8000] [--out benchmarks/results]

Two topologies of the same model, one after the other:

* single: one `kvrelay serve` with both cores (2 threads); prefill chunks and decodes
  share its steps (chunked prefill).
* 1P1D: `kvrelay deploy --prefill 1 --decode 1 --devices 0-1`: the prefill server pinned
  to core 0, the decode server to core 1, NIXL (UCX) between them, `kvrelay proxy` in
  front on --base-port.

Against each, two `kvrelay bench serve` clients run at once (the workload mix):

* generations: short prompts, long outputs (--gen-input/--gen-output), a fixed number
  in flight (--gen-concurrency) — its ITL is what a chat user feels;
* long prompts: --long-input tokens, a few output tokens, Poisson arrivals at
  --long-rate requests/s — the pressure.

Reported per topology: TTFT p50/p99 of both streams, ITL p50/p99 and output throughput of
the generation stream, and for 1P1D the KV bytes and transfer seconds per request read from
the decode server's /metrics. Goal (disaggregation issue): the generation stream's ITL p99
under 1P1D is at most half of the single instance's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import git_sha, log, machine_info  # noqa: E402 -- after the sys.path insert

PY = sys.executable
SERVE_FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--served-model-name", "bench"]


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def kv_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name in ("kvrelay:kv_transfers", "kvrelay:kv_transfer_bytes", "kvrelay:kv_transfer_seconds",
                 "kvrelay:kv_transfer_failures"):
        m = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text,
                      re.MULTILINE)
        out[name.split(":")[1]] = float(m.group(1)) if m else float("nan")
    return out


def bench(url: str, name: str, work: Path, args: argparse.Namespace,
          extra: list[str]) -> subprocess.Popen:
    cmd = [PY, "-m", "kvrelay.cli", "bench", "serve", "--base-url", url, "--model", "bench",
           "--dataset-name", "random", "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(work), "--result-filename", f"{name}.json",
           "--no-plot", *extra]
    with open(work / f"{name}.log", "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def run_workload(url: str, label: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    gen = bench(url, f"{label}-gen", work, args, [
        "--random-input-len", str(args.gen_input), "--random-output-len", str(args.gen_output),
        "--num-prompts", str(args.gen_prompts), "--max-concurrency", str(args.gen_concurrency)])
    time.sleep(args.pressure_delay)          # let the generations reach steady decoding first
    long = bench(url, f"{label}-long", work, args, [
        "--random-input-len", str(args.long_input), "--random-output-len", str(args.long_output),
        "--num-prompts", str(args.long_prompts), "--request-rate", str(args.long_rate)])
    for p in (gen, long):
        if p.wait(args.timeout) != 0:
            raise RuntimeError(f"bench client failed; see {work}/{label}-*.log")
    res = {}
    for stream in ("gen", "long"):
        data = json.loads((work / f"{label}-{stream}.json").read_text())
        res[stream] = {k: data.get(k) for k in (
            "completed", "failed", "duration", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2el_ms")}
    return res


def single(model: str, port: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    cmd = [PY, "-m", "kvrelay.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           *SERVE_FLAGS]
    log(f"single: {' '.join(cmd[3:])}")
    with open(work / "single-server.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_health(url, proc)
        return run_workload(url, "single", work, args)
    finally:
        stop(proc)


def disagg(model: str, base_port: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [PY, "-m", "kvrelay.cli", "deploy", "--model", model, "--prefill", "1", "--decode", "1",
           "--devices", "0-1", "--port", str(base_port), "--base-port", str(base_port),
           "--no-validate",
           "--served-model-name", "bench",
           "--log-dir", str(work / "deploy-logs"), "--", *SERVE_FLAGS[:4]]
    log(f"1P1D: {' '.join(cmd[3:])}")
    with open(work / "deploy.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url, decode_url = f"http://127.0.0.1:{base_port}", f"http://127.0.0.1:{base_port + 200}"
    try:
        deadline = time.monotonic() + 900
        while "OpenAI base URL" not in (work / "deploy.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("deploy did not come up:\n"
                                   f"{(work / 'deploy.log').read_text()[-2000:]}")
            time.sleep(0.5)
        before = kv_metrics(decode_url)
        res = run_workload(url, "disagg", work, args)
        after = kv_metrics(decode_url)
        n = after["kv_transfers"] - before["kv_transfers"]
        res["kv"] = {"transfers": n,
                     "failures": after["kv_transfer_failures"] - before["kv_transfer_failures"],
                     "bytes_per_request": (after["kv_transfer_bytes"]
                                           - before["kv_transfer_bytes"]) / max(n, 1),
                     "seconds_per_request": (after["kv_transfer_seconds"]
                                             - before["kv_transfer_seconds"]) / max(n, 1)}
        return res
    finally:
        stop(proc, timeout_s=90)


def report(results: dict[str, Any]) -> None:
    print(f"\n{'topology':<8} {'stream':<6} {'done':>5} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
          f"{'p99':>8} {'out tok/s':>9}")
    for topo in ("single", "disagg"):
        for stream in ("gen", "long"):
            r = results[topo][stream]
            print(f"{topo:<8} {stream:<6} {r['completed']:>5} {r['median_ttft_ms']:>9.0f} "
                  f"{r['p99_ttft_ms']:>8.0f} {r['median_itl_ms']:>8.1f} {r['p99_itl_ms']:>8.1f} "
                  f"{r['output_throughput']:>9.1f}")
    kv = results["disagg"]["kv"]
    print(f"KV per request (1P1D): {kv['bytes_per_request'] / 2**20:.1f} MiB in "
          f"{kv['seconds_per_request'] * 1e3:.1f} ms ({kv['transfers']:.0f} transfers, "
          f"{kv['failures']:.0f} failed)")
    d = results["derived"]
    print(f"generation ITL p99, 1P1D / single: {d['itl_p99_ratio']:.2f} (goal <= 0.5: "
          f"{'met' if d['itl_p99_ratio'] <= 0.5 else 'not met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    ap.add_argument("--base-port", type=int, default=8000)
    ap.add_argument("--gen-input", type=int, default=32)
    ap.add_argument("--gen-output", type=int, default=192)
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-concurrency", type=int, default=4)
    ap.add_argument("--long-input", type=int, default=1536)
    ap.add_argument("--long-output", type=int, default=4)
    ap.add_argument("--long-prompts", type=int, default=8)
    ap.add_argument("--long-rate", type=float, default=0.4)
    ap.add_argument("--pressure-delay", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.model is None:
        from kvrelay.model.embedded import embedded_model_dir
        args.model = str(embedded_model_dir())
    work = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    log(f"work dir {work}")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "machine": machine_info() | {"kvrelay_git": git_sha()},
                               "model": args.model, "serve_flags": SERVE_FLAGS,
                               "workload": {k: v for k, v in vars(args).items()
                                            if k not in ("out", "model")}}
    results["single"] = single(args.model, args.base_port + 50, work, args)
    results["disagg"] = disagg(args.model, args.base_port, work, args)
    g1, g2 = results["single"]["gen"], results["disagg"]["gen"]
    results["derived"] = {"itl_p99_ratio": g2["p99_itl_ms"] / g1["p99_itl_ms"],
                          "itl_p50_ratio": g2["median_itl_ms"] / g1["median_itl_ms"],
                          "gen_throughput_ratio": g2["output_throughput"] / g1["output_throughput"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "disagg.json").write_text(json.dumps(results, indent=1))
    report(results)
    log(f"results in {out / 'disagg.json'}")


if __name__ == "__main__":
    main()
