"""A Ray-placed 2P1D against the same topology from `kvrelay deploy` on one host (issue 27's
targets): time to ready, output throughput of the same `kvrelay bench serve` workload, how
long a killed server takes to serve again, and the failed requests of a scale step under load.

    python benchmarks/ray_deploy.py [--model DIR] [--num-prompts 24] [--out FILE]

Starts its own Ray cluster on 127.0.0.1 (three nodes: a head with no CPUs for actors and two
with 3 logical CPUs each — on one machine the nodes share its cores, so this measures what Ray
adds, not more hardware), runs the local deploy, then the Ray deploy, one after the other, with
the same ports. Progress goes to stderr; the JSON result to --out (and stdout).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"          # every node on 127.0.0.1

import httpx

BASE, SIDE = 23400, 13400
KVRELAY = [sys.executable, "-m", "kvrelay.cli"]


def say(text: str) -> None:
    print(f"[ray_deploy] {text}", file=sys.stderr, flush=True)


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def bench(url: str, args: argparse.Namespace, tag: str, out_dir: Path) -> dict:
    cmd = KVRELAY + ["bench", "serve", "--base-url", url, "--dataset-name", "random",
                     "--random-input-len", str(args.input_len), "--random-output-len",
                     str(args.output_len), "--num-prompts", str(args.num_prompts),
                     "--max-concurrency", str(args.concurrency), "--ignore-eos",
                     "--save-result", "--result-dir", str(out_dir), "--result-filename",
                     f"{tag}.json"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / f"{tag}.json").read_text())


STAMP = re.compile(r"^INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+): (.*)$", re.M)


def kv_touch_s(log_dir: Path) -> dict[str, float]:
    """Each server's seconds from its weights loaded to its KV cache allocated, from the
    last run in its log: the first touch of ~1 GiB, which this benchmark's VMs serve from
    memory the host gives back lazily (0.3 s warm, up to ~10 s a GiB cold) — the one step
    that swings a bring-up by itself, so each round records it beside its ready time."""
    out = {}
    for log in sorted(log_dir.glob("*.log")):
        loaded = kv = None
        for when, who, what in STAMP.findall(log.read_text(errors="replace")):
            t = time.mktime(time.strptime(when[:19], "%Y-%m-%d %H:%M:%S")) + int(when[20:]) / 1e3
            if who == "kvrelay.model.loader" and what.startswith("loaded"):
                loaded, kv = t, None
            elif who == "kvrelay.engine.runner" and what.startswith("KV cache:"):
                kv = t
        if loaded is not None and kv is not None:
            out[log.stem] = round(kv - loaded, 2)
    return out


def topology(args: argparse.Namespace) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return [*model, "--prefill", "2", "--decode", "1", "--port", str(BASE),
            "--base-port", str(BASE), "--side-channel-port", str(SIDE)]


def local_run(args: argparse.Namespace, out_dir: Path) -> dict:
    say("local deploy: starting")
    load = os.getloadavg()[0]
    started = time.strftime("%H:%M:%S")   # wall clock: the servers' logs
    proc, ready = local_up(args, out_dir)
    say(f"local deploy: ready in {ready:.1f}s; benchmarking")
    try:
        result = bench(f"http://127.0.0.1:{BASE}", args, "local", out_dir)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    return {"ready_s": ready, "output_throughput": result["output_throughput"],
            "median_ttft_ms": result["median_ttft_ms"], "median_tpot_ms": result["median_tpot_ms"],
            "started": started, "load": load, "kv_touch_s": kv_touch_s(out_dir / "local-logs")}


def ray_run(args: argparse.Namespace, address: str, out_dir: Path) -> dict:
    common = ["--name", "bench", "--ray-address", address]
    say("Ray deploy: placing")
    load = os.getloadavg()[0]
    t0, started = time.monotonic(), time.strftime("%H:%M:%S")
    up = subprocess.run(KVRELAY + ["deploy", "--backend", "ray", *common, *topology(args),
                                   "--log-dir", str(out_dir / "ray-logs")],
                        capture_output=True, text=True)
    ready = time.monotonic() - t0
    if up.returncode != 0:
        raise RuntimeError(up.stdout + up.stderr)
    url = re.search(r"OpenAI base URL: (http://[\d.:]+)/v1", up.stdout)[1]  # type: ignore[index]
    say(f"Ray deploy: ready in {ready:.1f}s; benchmarking")
    try:
        result = bench(url, args, "ray", out_dir)
        back = kill_and_time(url)
        say(f"Ray deploy: a killed prefill served again after {back['serving_again_s']:.1f}s")
        scale = scale_under_load(url, common)
        say(f"Ray deploy: scale steps {scale}")
    finally:
        subprocess.run(KVRELAY + ["deploy", "--down", *common], capture_output=True)
    said = [ln for ln in up.stdout.splitlines() if "ready in" in ln or "placed" in ln]
    (out_dir / f"ray-deploy-{started}.out").write_text(up.stdout)
    return {"ready_s": ready, "output_throughput": result["output_throughput"],
            "median_ttft_ms": result["median_ttft_ms"],
            "median_tpot_ms": result["median_tpot_ms"], **back, "scale": scale,
            "deploy_said": said, "started": started, "load": load,  # said: its phases
            "kv_touch_s": kv_touch_s(out_dir / "ray-logs")}


def local_up(args: argparse.Namespace, out_dir: Path) -> tuple[subprocess.Popen, float]:
    """`kvrelay deploy` started here, once it says it is ready: (its process, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(KVRELAY + ["deploy", *topology(args), "--no-validate",
                                       "--log-dir", str(out_dir / "local-logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "Ctrl-C stops everything" in line:
            break
    return proc, time.monotonic() - t0


def local_up_down(args: argparse.Namespace, out_dir: Path) -> float:
    """One local bring-up's ready seconds (as local_run measures it), then down."""
    proc, ready = local_up(args, out_dir)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(120)
    say(f"local deploy: ready in {ready:.1f}s")
    return ready


def ray_up_down(args: argparse.Namespace, address: str, out_dir: Path) -> float:
    """One Ray bring-up's ready seconds (as ray_run measures it), then down."""
    common = ["--name", "bench", "--ray-address", address]
    t0 = time.monotonic()
    up = subprocess.run(KVRELAY + ["deploy", "--backend", "ray", *common, *topology(args),
                                   "--log-dir", str(out_dir / "ray-logs")],
                        capture_output=True, text=True)
    ready = time.monotonic() - t0
    subprocess.run(KVRELAY + ["deploy", "--down", *common], capture_output=True)
    if up.returncode != 0:
        raise RuntimeError(up.stdout + up.stderr)
    say(f"Ray deploy: ready in {ready:.1f}s")
    return ready


def serve_pid(port: int) -> int:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd and str(port).encode() in cmd and b"kvrelay.cli" in cmd:
                return int(pid)
    raise LookupError(port)


def kill_and_time(url: str) -> dict:
    port = BASE + 100
    os.kill(serve_pid(port), signal.SIGKILL)
    t0 = time.monotonic()
    wait_http(f"http://127.0.0.1:{port}/health", 300)
    again = time.monotonic() - t0
    while True:
        text = httpx.get(f"{url}/metrics").text
        active = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                  if ln.startswith('kvrelay_proxy:backends{role="prefill",state="active"}')]
        if active and active[0] >= 2:
            break
        time.sleep(0.2)
    return {"serving_again_s": again, "proxy_took_back_s": time.monotonic() - t0}


def scale_under_load(url: str, common: list[str]) -> dict:
    failed, done = [], [0]
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(f"{url}/v1/completions", json={"prompt": "hello " * 16,
                                                          "max_tokens": 8, "ignore_eos": True})
                done[0] += 1
                if r.status_code != 200:
                    failed.append(r.status_code)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    steps = {}
    for n in (3, 1):
        t0 = time.monotonic()
        r = subprocess.run(KVRELAY + ["deploy", "scale", *common, "--prefill", str(n)],
                           capture_output=True, text=True)
        steps[f"prefill_to_{n}_s"] = time.monotonic() - t0
        if r.returncode != 0:
            steps[f"prefill_to_{n}_error"] = r.stdout[-500:] + r.stderr[-500:]
    stop.set()
    t.join(120)
    return {**steps, "requests": done[0], "failed": len(failed)}


def _median_run(runs: list[dict]) -> dict:
    """Each numeric figure's median over the rounds (the scale steps: the worst round)."""
    import statistics
    out: dict = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
        elif key == "scale":
            out[key] = max((r[key] for r in runs), key=lambda s: s.get("failed", 0))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2, help="rounds of local then Ray")
    p.add_argument("--ready-repeat", type=int, default=0,
                   help="more rounds of bring-up only (local up/down, then Ray up/down): the "
                        "ready figure, the noisiest, from more samples")
    p.add_argument("--out", type=Path, default=Path("ray_deploy.json"))
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds of quiet before each bring-up (the last one's teardown done)")
    args = p.parse_args()
    out_dir = args.out.parent / (args.out.stem + "-runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=3)
        cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        locals_, rays = [], []
        ready_local: list[float] = []
        ready_ray: list[float] = []
        for r in range(args.repeat):                 # alternated: drift hits both alike
            say(f"round {r + 1} of {args.repeat}")
            time.sleep(args.settle)        # after a teardown: the same start for both
            locals_.append(local_run(args, out_dir))
            time.sleep(args.settle)
            rays.append(ray_run(args, cluster.address, out_dir))
        for r in range(args.ready_repeat):
            say(f"bring-up round {r + 1} of {args.ready_repeat}")
            time.sleep(args.settle)
            ready_local.append(local_up_down(args, out_dir))
            time.sleep(args.settle)
            ready_ray.append(ray_up_down(args, cluster.address, out_dir))
    finally:
        cluster.shutdown()
    local, ray = _median_run(locals_), _median_run(rays)
    if ready_local:                        # every bring-up counts for the ready figure
        import statistics
        local["ready_s"] = statistics.median([r["ready_s"] for r in locals_] + ready_local)
        ray["ready_s"] = statistics.median([r["ready_s"] for r in rays] + ready_ray)
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load": os.getloadavg(), "model": args.model or "embedded",
              "workload": {k: getattr(args, k) for k in ("num_prompts", "concurrency",
                                                         "input_len", "output_len")},
              "local": local, "ray": ray, "rounds": {"local": locals_, "ray": rays},
              "bring_up_only": {"local_ready_s": ready_local, "ray_ready_s": ready_ray},
              "ratios": {"throughput_ray_over_local":
                         ray["output_throughput"] / local["output_throughput"],
                         "ready_ray_over_local": ray["ready_s"] / local["ready_s"]}}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
