"""How long `kvrelay serve` (the embedded model) takes from its start to serving.

    cold start: empty model and kernel caches (KVRELAY_CACHE_DIR, KVRELAY_KERNELS_DIR and
                XDG_CACHE_HOME in a fresh temporary directory; your own caches are not read
                or touched): the embedded model is built, the native kernels compile
      t0 ── `kvrelay serve` started
      health     first GET /health 200
      completion the README's completion (temperature 0) answered, sent at `health`
      native     kvrelay:native_kernels_ready 1 on /metrics (the kernels in use); the same
                 completion is sent again then and must answer the same text
    warm start: the same caches again (a second `kvrelay serve`)

Each run records the 1-minute load average (sampled every second) and the log's own
times (embedded model build, kernel build). Results: JSON in benchmarks/results/.

    python benchmarks/cold_start.py [--runs 2] [--kernels-build background|wait]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "kvrelay/smollm2-135m-gpt-oss"
PROMPT = "The capital of France is"
READY_TIMEOUT_S = 600
NATIVE_TIMEOUT_S = 1200
# the log's own times: (name, pattern with one number in seconds)
LOG_TIMES = (("embedded_model_build_s", r"built the embedded model .* in ([\d.]+) s"),
             ("kernel_build_s", r"native kernels built in ([\d.]+) s"),
             ("switch_after_build_s", r"native kernels ready after ([\d.]+) s"))
# when the engine core's timestamped lines say it reached a step: (name, text in the line)
PHASES = (("engine_core_first_line", "kvrelay."), ("model_loaded", "kvrelay.model.loader: loaded"),
          ("kv_cache_allocated", "kvrelay.engine.runner: KV cache"),
          ("warm_up_done", "warm-up done"), ("switched", "native kernels ready after"))
STAMP = re.compile(r"^INFO (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


class LoadSampler:
    """The 1-minute load average, sampled every second on a thread while a run goes on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        s = self.samples or [os.getloadavg()[0]]
        return {"min": min(s), "mean": round(statistics.fmean(s), 2), "max": max(s)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def complete(base: str) -> str:
    status, text = http(f"{base}/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                   "max_tokens": 16, "temperature": 0},
                        timeout=120)
    if status != 200:
        raise RuntimeError(f"completion answered {status}: {text[:500]}")
    return str(json.loads(text)["choices"][0]["text"])


def native_ready(base: str) -> bool | None:
    """kvrelay:native_kernels_ready from /metrics (None: not exported yet)."""
    status, text = http(f"{base}/metrics")
    found = re.search(r"^kvrelay:native_kernels_ready\{[^}]*\} ([\d.]+)", text, re.M)
    return None if status != 200 or not found else float(found[1]) == 1.0


def serve_command() -> list[str]:
    """`kvrelay serve` as a user runs it: the venv's console script."""
    script = Path(sys.executable).with_name("kvrelay")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvrelay.cli"]


def phases(log: str, wall_start: float) -> dict[str, float]:
    """Seconds from the start to each of PHASES, from the engine core's timestamped lines."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        stamped = STAMP.match(line)
        if stamped is None:
            continue
        at = time.mktime(time.strptime(stamped[1][:19], "%Y-%m-%d %H:%M:%S"))
        at += int(stamped[1][20:]) / 1000
        for name, text in PHASES:
            if name not in out and text in stamped[2]:
                out[name] = round(at - wall_start, 2)
    return out


def one_start(caches: Path, env: dict[str, str], wait_native: bool) -> dict[str, Any]:
    """Start `kvrelay serve`, time it, stop it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = caches / f"serve-{time.strftime('%H%M%S')}.log"
    load = LoadSampler()
    wall_start, t0 = time.time(), time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command() + ["serve", "--port", str(port)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict[str, Any] = {}
    try:
        while http(f"{base}/health", timeout=1.0)[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"kvrelay serve exited {proc.returncode}: "
                                   f"{log_path.read_text()[-2000:]}")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise TimeoutError(f"no /health 200 within {READY_TIMEOUT_S} s")
            time.sleep(0.1)
        result["health_s"] = round(time.monotonic() - t0, 2)
        result["answer"] = complete(base)
        result["completion_s"] = round(time.monotonic() - t0, 2)
        result["native_at_ready"] = native_ready(base)
        if wait_native and not result["native_at_ready"]:
            while not native_ready(base):
                if time.monotonic() - t0 > NATIVE_TIMEOUT_S:
                    raise TimeoutError(f"no native kernels within {NATIVE_TIMEOUT_S} s")
                time.sleep(0.5)
            result["native_s"] = round(time.monotonic() - t0, 2)
            result["answer_after_switch"] = complete(base)
            result["same_answer_after_switch"] = (result["answer_after_switch"]
                                                  == result["answer"])
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        result["load_1min"] = load.stop()
    text = log_path.read_text()
    for name, pattern in LOG_TIMES:
        found = re.search(pattern, text)
        if found:
            result[name] = float(found[1])
    result["phases_s"] = phases(text, wall_start)
    result["log"] = str(log_path)
    return result


def one_run(mode: str, keep: bool) -> dict[str, Any]:
    """A cold start on empty caches, then a warm start on the same caches."""
    caches = Path(tempfile.mkdtemp(prefix="kvrelay-cold-start-"))
    env = os.environ | {"KVRELAY_CACHE_DIR": str(caches / "kvrelay"),
                        "KVRELAY_KERNELS_DIR": str(caches / "kernels"),
                        "XDG_CACHE_HOME": str(caches / "xdg"),
                        "KVRELAY_KERNELS_BUILD": mode, "PYTHONUNBUFFERED": "1"}
    try:
        print(f"[{time.strftime('%H:%M:%S')}] cold start ({mode}) in {caches}", file=sys.stderr)
        cold = one_start(caches, env, wait_native=True)
        print(f"[{time.strftime('%H:%M:%S')}] cold: {summary(cold)}; warm start", file=sys.stderr)
        warm = one_start(caches, env, wait_native=False)
        print(f"[{time.strftime('%H:%M:%S')}] warm: {summary(warm)}", file=sys.stderr)
    finally:
        if not keep:
            shutil.rmtree(caches, ignore_errors=True)
    return {"cold": cold, "warm": warm}


def summary(r: dict[str, Any]) -> str:
    return (f"/health {r['health_s']} s, completion {r['completion_s']} s, native "
            f"{r.get('native_s', 'at ready' if r['native_at_ready'] else 'no')}, load "
            f"{r['load_1min']['mean']}")


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)[1].split()) \
        if "flags" in cpuinfo else set()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"cpu": model[1] if model else platform.processor(),
            "isa": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}),
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "torch": metadata.version("torch"), "kvrelay_commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="cold+warm pairs (default 2)")
    p.add_argument("--kernels-build", choices=("background", "wait"), default="background",
                   help="KVRELAY_KERNELS_BUILD for the servers (default background)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/cold_start-<mode>-<date>.json)")
    p.add_argument("--keep", action="store_true", help="keep the temporary caches and logs")
    args = p.parse_args()
    runs = [one_run(args.kernels_build, args.keep) for _ in range(args.runs)]
    result = {"machine": machine(), "kernels_build": args.kernels_build, "runs": runs}
    out = args.out or (ROOT / "benchmarks" / "results" /
                       f"cold_start-{args.kernels_build}-{time.strftime('%Y-%m-%d-%H%M')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
