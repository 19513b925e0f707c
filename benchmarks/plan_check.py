"""`kvrelay plan`, checked by experiment: deploy its recommendation and the neighbouring
topologies, each server held to a fixed CPU capacity, and see which meet the targets.

    python benchmarks/plan_check.py            # full: 2 rounds, ~10 min
    python benchmarks/plan_check.py --quick    # 1 round, 24 requests per run, ~3 min

Needs root and a writable cgroup v1 cpu controller at /sys/fs/cgroup/cpu (docs/deploy.md).

Every server runs with one torch thread (OMP_NUM_THREADS=1) and, once it is ready, is
moved with its whole process tree (API server + engine core) into a cgroup of its own with
`cpu.cfs_quota_us / cpu.cfs_period_us` = --core-quota cores (0.2: 2 ms of CPU every 10 ms)
and a high `cpu.shares`, so that its capacity is the same whichever other work runs on
the machine, as long as the quotas sum to well under the cores that are free. Then a
second server adds a second server's worth of capacity, which is what a plan assumes.

1. Calibrate on a fresh 1P1D (`kvrelay bench serve`, result files `kvrelay plan` reads):
   the prefill server alone at concurrency 1 (prefill tokens/s), then through the proxy
   at concurrency 1 (ITL at batch 1; the hand-off: its TTFT minus the prefill's and one
   step) and B (B / mean ITL: decode tokens/s at batch B, KV intake included).
2. Choose a workload (kvrelay.plan.check.choose_targets: an arrival rate that keeps
   --demand prefill servers busy, TTFT/ITL targets a few times a lone request's) and run
   `kvrelay plan` on the calibration files.
3. Deploy the recommendation and its neighbours ((x-1)PyD, (x+1)PyD, xP(y±1)D that fit in
   --max-servers), one after the other on fresh servers, each driven at the planned rate
   with Poisson arrivals (`kvrelay bench serve --request-rate`).
4. Write the table (topology, servers, TTFT/ITL mean/p50/p99, throughput, targets met) and
   the verdict: does the recommendation meet the targets with the fewest servers.

Results: benchmarks/results/plan-check[-quick].{json,md}. Every process is stopped by PID
and every cgroup removed at the end, also on failure or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import CONFIGS, build_checkpoint, git_sha, log, machine_info  # noqa: E402

from kvrelay.plan.capacity import (  # noqa: E402
    Measured,
    Workload,
    decode_from_result,
    prefill_from_result,
)
from kvrelay.plan.check import (  # noqa: E402
    Run,
    Targets,
    choose_targets,
    neighbour_topologies,
    parse_recommendation,
    planned_ttft_ms,
    run_from_result,
    table,
    verdict,
)

PY = sys.executable
SERVED = "bench"
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
# compute-heavier than benchmarks/common.py's "tiny" (hidden 384, 6 heads): prefill work,
# not HTTP overhead, dominates a prefill server's time under a fraction of a core
MODEL_CFG = CONFIGS["tiny"] | dict(hidden_size=384, intermediate_size=384, head_dim=64,
                                   num_attention_heads=6, num_key_value_heads=2)


def uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- cgroups

def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(d.name))
    return out


def process_tree(pid: int) -> list[int]:
    kids, todo, seen = _children(), [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo.extend(kids.get(p, []))
    return seen


class Cgroups:
    """Per-server cpu cgroups (v1): a CFS quota caps each at `cores`, high shares keep the
    scheduler from starving it below that. remove() empties and deletes every group."""

    def __init__(self, cores: float, period_us: int, shares: int) -> None:
        self.cores, self.period_us, self.shares = cores, period_us, shares
        self.groups: dict[str, Path] = {}

    def add(self, name: str, pid: int) -> None:
        path = CGROUP_ROOT / f"kvrelay-plan-check-{os.getpid()}-{name}"
        if name not in self.groups:
            path.mkdir()
            self.groups[name] = path
            (path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (path / "cpu.cfs_quota_us").write_text(str(round(self.cores * self.period_us)))
            (path / "cpu.shares").write_text(str(self.shares))
        for p in process_tree(pid):
            try:
                (path / "cgroup.procs").write_text(str(p))
            except OSError:
                pass                                   # exited in between

    def harness(self, cores: float) -> None:
        """This script, and so the proxies and bench clients it starts, in a group of its
        own: high shares (the measuring side is not starved by other work), at most
        `cores`. Servers start here too and move to their own group once ready."""
        path = CGROUP_ROOT / f"kvrelay-plan-check-{os.getpid()}-harness"
        path.mkdir()
        self.groups["harness"] = path
        (path / "cpu.cfs_period_us").write_text("100000")
        (path / "cpu.cfs_quota_us").write_text(str(round(cores * 100000)))
        (path / "cpu.shares").write_text(str(self.shares))
        (path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict[str, dict[str, int]]:
        out = {}
        for name, path in self.groups.items():
            text = (path / "cpu.stat").read_text()
            out[name] = {k: int(v) for k, v in (ln.split() for ln in text.splitlines())}
        return out

    def remove(self) -> None:
        if "harness" in self.groups:
            (CGROUP_ROOT / "cgroup.procs").write_text(str(os.getpid()))
        for name, path in list(self.groups.items()):
            try:
                for p in (path / "cgroup.procs").read_text().split():
                    try:
                        (CGROUP_ROOT / "cgroup.procs").write_text(p)
                    except OSError:
                        pass
                path.rmdir()
            except OSError as e:
                log(f"cgroup {path}: not removed: {e}")
            del self.groups[name]


# ---------------------------------------------------------------- processes

class Procs:
    """Every process this script starts, stopped by PID (leader first, then its group)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen:
        out = open(self.work / f"{name}.log", "w")  # noqa: SIM115 -- the child keeps it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | (env or {}), start_new_session=True)
        self.procs[name] = proc
        return proc

    def wait_ready(self, names: list[str], timeout_s: float = 600,
                   on_ready: Any = None) -> None:
        deadline, left = time.monotonic() + timeout_s, list(names)
        while left:
            for name in list(left):
                if "Application startup complete" in (self.work / f"{name}.log").read_text():
                    left.remove(name)
                    if on_ready:
                        on_ready(name, self.procs[name].pid)
                elif self.procs[name].poll() is not None or time.monotonic() > deadline:
                    tail = (self.work / f"{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{name} did not start:\n{tail}")
            time.sleep(0.3)

    def stop(self, names: list[str] | None = None) -> None:
        names = list(self.procs) if names is None else names
        for name in names:                              # proxies first: no new requests
            p = self.procs[name]
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 40
        for name in names:
            p = self.procs.pop(name)
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)        # what is left of its group
            except ProcessLookupError:
                pass
            p.wait()


def serve_cmd(model: Path, role: str, port: int, max_num_seqs: int, max_len: int) -> list[str]:
    # TCP, not NIXL: NIXL's progress thread polls even when idle (~0.4 core measured
    # here), which would eat most of a 0.2-core quota; the plan is about capacity, not the
    # transport (the hand-off is measured with whichever one runs)
    kv = {"kv_connector": "TcpConnector", "kv_role": role,
          "kv_connector_extra_config": {"backends": ["TCP"]}}
    return [PY, "-m", "kvrelay.cli", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED, "--max-model-len", str(max_len),
            "--max-num-seqs", str(max_num_seqs), "--kv-transfer-config", json.dumps(kv)]


class Topology:
    """x prefill + y decode servers, each in its own quota'd cgroup, and a proxy."""

    def __init__(self, procs: Procs, cg: Cgroups, model: Path, x: int, y: int,
                 prefill_seqs: int, decode_seqs: int, args: argparse.Namespace) -> None:
        self.procs, self.cg, self.tag = procs, cg, f"{x}P{y}D"
        secret = secrets.token_hex(32)
        self.ports: dict[str, int] = {}
        names = [f"{self.tag}-decode-{i}" for i in range(y)] + \
                [f"{self.tag}-prefill-{i}" for i in range(x)]
        for name in names:
            role = "kv_consumer" if "-decode-" in name else "kv_producer"
            port = self.ports[name] = free_port()
            env = {"OMP_NUM_THREADS": "1", "KVRELAY_KV_SECRET": secret,
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            seqs = decode_seqs if role == "kv_consumer" else prefill_seqs
            procs.start(name, serve_cmd(model, role, port, seqs, args.max_model_len), env)
        self.servers = names
        t0 = time.monotonic()
        procs.wait_ready(names, on_ready=lambda n, pid: cg.add(n, pid))
        log(f"{self.tag}: {len(names)} server(s) ready in {time.monotonic() - t0:.0f}s, each "
            f"in a cgroup of {cg.cores:g} core")
        self.port = free_port()
        pre = [str(self.ports[n]) for n in names if "-prefill-" in n]
        dec = [str(self.ports[n]) for n in names if "-decode-" in n]
        procs.start(f"{self.tag}-proxy", [
            PY, "-m", "kvrelay.cli", "proxy", "--host", "127.0.0.1", "--port", str(self.port),
            "--prefiller-port", *pre, "--decoder-port", *dec, "--disagg-policy", "always"])
        procs.wait_ready([f"{self.tag}-proxy"], 120)

    def url(self, name: str | None = None) -> str:
        return f"http://127.0.0.1:{self.ports[name] if name else self.port}"

    def server_ttft_ms(self) -> dict[str, float]:
        """Mean TTFT each server saw (its own vllm:time_to_first_token histogram): where a
        request's TTFT went, prefill side and decode side."""
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for name in self.servers:
            text = httpx.get(f"{self.url(name)}/metrics", timeout=30).text
            tot = {"sum": 0.0, "count": 0.0}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name.startswith("vllm:time_to_first_token_seconds_"):
                        key = s.name.rsplit("_", 1)[1]
                        if key in tot:
                            tot[key] += s.value
            out[name] = tot["sum"] / tot["count"] * 1e3 if tot["count"] else float("nan")
        return out

    def stop(self) -> dict[str, Any]:
        stats = {n: s for n, s in self.cg.stats().items() if n in self.servers}
        self.procs.stop([f"{self.tag}-proxy", *self.servers])
        return stats


def bench(url: str, model: Path, work: Path, name: str, prompt_len: int, output_len: int,
          num: int, seed: int, extra: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [PY, "-m", "kvrelay.cli", "bench", "serve", "--base-url", url, "--model", SERVED,
           "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len",
           str(prompt_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
           "--num-prompts", str(num), "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
           "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--no-plot", "--result-dir", str(work),
           "--result-filename", f"{name}.json", *extra]
    with open(work / f"{name}.bench.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout_s)
        finally:                                        # timeout, Ctrl-C, SIGTERM
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"bench {name} failed (rc {rc}): {work / name}.bench.log")
    data: dict[str, Any] = json.loads((work / f"{name}.json").read_text())
    keys = ("completed", "failed", "duration", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "output_throughput",
            "request_throughput")
    log(f"{name}: " + ", ".join(f"{k} {data.get(k)!s:.8}" for k in keys))
    return data


# ---------------------------------------------------------------- the three steps

def calibrate(procs: Procs, cg: Cgroups, model: Path, work: Path,
              a: argparse.Namespace) -> tuple[Measured, float, dict[str, Any]]:
    # the prefill server's KV cache (sized by --max-num-seqs) must hold the KV of the
    # requests waiting for the decode server: with 4 seqs of 1024 tokens it held two 512-token
    # prompts and refused the rest (HTTP 503 "KV hold refused"); the plan's own value
    prefill_seqs = max(a.cal_batch, 8192 // a.prompt_len)
    topo = Topology(procs, cg, model, 1, 1, prefill_seqs, a.cal_batch, a)
    try:
        pre = topo.servers[1]
        for url in (topo.url(pre), topo.url()):               # first requests are slower
            bench(url, model, work, "warm-up", a.prompt_len, 4, 2, 0, ["--max-concurrency", "1"],
                  a.timeout)
        bench(topo.url(pre), model, work, "cal-prefill", a.prompt_len, 1, a.cal_prompts, 1,
              ["--max-concurrency", "1"], a.timeout)
        # decode through the proxy with the workload's prompts: the decode server's steps
        # then share its CPU with KV intake, as they will in the deployment (measured
        # directly, with local 8-token prompts, the ITL came out ~1.5x too optimistic)
        d1 = bench(topo.url(), model, work, "cal-decode-1", a.prompt_len, a.cal_output,
                   a.cal_prompts // 2, 2, ["--max-concurrency", "1"], a.timeout)
        bench(topo.url(), model, work, "cal-decode-b", a.prompt_len, a.cal_output,
              3 * a.cal_batch, 3, ["--max-concurrency", str(a.cal_batch)], a.timeout)
    finally:
        stats = topo.stop()
    for name in ("cal-prefill", "cal-decode-1", "cal-decode-b"):
        failed = json.loads((work / f"{name}.json").read_text()).get("failed")
        if failed:                                     # a measurement of part of the load
            raise RuntimeError(f"calibration {name}: {failed} request(s) failed; see "
                               f"{work / name}.bench.log and the server logs in {work}")
    p_tok_s = prefill_from_result(str(work / "cal-prefill.json"))
    d_tok_s, batch, _ = decode_from_result(str(work / "cal-decode-b.json"))
    itl1 = float(d1["mean_itl_ms"])
    pre_ttft = json.loads((work / "cal-prefill.json").read_text())["mean_ttft_ms"]
    handoff = max(0.0, float(d1["mean_ttft_ms"]) - pre_ttft - itl1)
    log(f"calibrated: prefill {p_tok_s:.0f} tok/s, decode {d_tok_s:.1f} tok/s at batch {batch}, "
        f"ITL at 1 {itl1:.1f} ms, hand-off {handoff:.0f} ms")
    return Measured(p_tok_s, d_tok_s, batch, itl1), handoff, {"cgroup_stats": stats}


def run_plan(work: Path, m: Measured, handoff: float, t: Targets) -> tuple[str, list[str]]:
    cmd = ["kvrelay", "plan", "--prefill-result", str(work / "cal-prefill.json"),
           "--decode-result", str(work / "cal-decode-b.json"), "--itl-at-1-ms",
           f"{m.itl_at_1_ms:.2f}", "--rate", f"{t.rate:.4f}", "--prompt-len", str(t.prompt_len),
           "--output-len", str(t.output_len), "--ttft-ms", f"{t.ttft_ms:.0f}",
           "--itl-ms", f"{t.itl_ms:.1f}", "--handoff-ms", f"{handoff:.0f}"]
    res = subprocess.run([PY, "-m", "kvrelay.cli", *cmd[1:]], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise RuntimeError(f"kvrelay plan failed: {res.stdout}{res.stderr}")
    return res.stdout, cmd


def run_topology(procs: Procs, cg: Cgroups, model: Path, work: Path, a: argparse.Namespace,
                 t: Targets, x: int, y: int, pre_seqs: int, dec_seqs: int, rnd: int,
                 res: dict[str, Any]) -> Run:
    """Fresh xPyD servers and proxy, driven at the planned rate, stopped again."""
    topo = Topology(procs, cg, model, x, y, pre_seqs, dec_seqs, a)
    key = f"round{rnd + 1}-{topo.tag}"
    try:
        # one seed for every run: the same prompts and arrival times for every topology
        # (fresh servers each time, so no prefix-cache reuse between runs)
        d = bench(topo.url(), model, work, f"run-{key}", t.prompt_len, t.output_len,
                  a.num_prompts, a.seed, ["--request-rate", f"{t.rate:.4f}"], a.timeout)
        sides = topo.server_ttft_ms()
        res.setdefault("server_ttft_ms", {})[key] = sides
        log(f"{key}: mean TTFT per server {sides}")
    finally:
        res.setdefault("cgroup_stats", {})[key] = topo.stop()
    res.setdefault("uptime_runs", {})[key] = uptime()
    return run_from_result(x, y, a.num_prompts, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer prompts")
    ap.add_argument("--core-quota", type=float, default=0.2, help="cores per server")
    ap.add_argument("--period-us", type=int, default=10_000)
    ap.add_argument("--shares", type=int, default=8192)
    ap.add_argument("--harness-cores", type=float, default=1.0,
                    help="CPU cap of this script, the proxies and the bench clients")
    ap.add_argument("--max-servers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--demand", type=float, default=1.2,
                    help="prefill servers' worth of work the arrival rate brings")
    ap.add_argument("--ttft-factor", type=float, default=2.5)
    ap.add_argument("--itl-factor", type=float, default=2.0)
    ap.add_argument("--num-prompts", type=int, default=None, help="per topology")
    ap.add_argument("--seed", type=int, default=100, help="of the measured runs' workload")
    ap.add_argument("--rounds", type=int, default=None,
                    help="every topology this many times, alternating order (full: 2)")
    ap.add_argument("--cal-prompts", type=int, default=None)
    ap.add_argument("--cal-batch", type=int, default=4)
    ap.add_argument("--cal-output", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    a.num_prompts = a.num_prompts or (24 if a.quick else 120)
    a.rounds = a.rounds or (1 if a.quick else 2)
    a.cal_prompts = a.cal_prompts or (8 if a.quick else 16)
    if not (CGROUP_ROOT / "cpu.cfs_quota_us").exists() or not os.access(CGROUP_ROOT, os.W_OK):
        sys.exit(f"plan_check: needs a writable cgroup v1 cpu controller at {CGROUP_ROOT}")
    model = build_checkpoint("plancheck", MODEL_CFG)
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    log(f"work dir {work}; {uptime()}")
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info() | {"kvrelay_git": git_sha()}, "uptime_before": uptime(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(a),
        "model": str(model)}
    procs, cg = Procs(work), Cgroups(a.core_quota, a.period_us, a.shares)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))       # run the finally below
    try:
        cg.harness(a.harness_cores)
        m, handoff, cal = calibrate(procs, cg, model, work, a)
        t = choose_targets(m, handoff, a.prompt_len, a.output_len, a.demand, a.ttft_factor,
                           a.itl_factor)
        plan_text, plan_cmd = run_plan(work, m, handoff, t)
        x, y, pre_seqs, dec_seqs = parse_recommendation(plan_text)
        log(f"kvrelay plan: {x}P{y}D\n{plan_text}")
        res |= {"calibration": {"measured": vars(m), "handoff_ms": handoff, **cal},
                "targets": vars(t), "plan_command": " ".join(plan_cmd), "plan_output": plan_text,
                "recommended": f"{x}P{y}D", "uptime_after_calibration": uptime()}
        topos = neighbour_topologies(x, y, a.max_servers)
        w = Workload(t.rate, t.prompt_len, t.output_len, t.ttft_ms, t.itl_ms, handoff)
        pred = {(px, py): planned_ttft_ms(m, w, px, py, dec_seqs) for px, py in topos}
        for rnd in range(a.rounds):               # later rounds in the reverse order
            order = topos if rnd % 2 == 0 else topos[::-1]
            runs = [run_topology(procs, cg, model, work, a, t, px, py, pre_seqs, dec_seqs,
                                 rnd, res) for px, py in order]
            res.setdefault("rounds", []).append({
                "runs": [vars(r) | {"meets": r.meets(t)} for r in runs],
                "table": table(runs, t, (x, y), pred), "verdict": verdict(runs, t, (x, y))})
    finally:
        procs.stop()
        cg.remove()
        res["uptime_after"] = uptime()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "plan-check" + ("-quick" if a.quick else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(report(res))
    print(report(res))
    log(f"results in {out / stem}.{{json,md}}; logs in {work}")


def report(res: dict[str, Any]) -> str:
    t, m = res["targets"], res["calibration"]["measured"]
    return "\n".join([
        f"{res['date']}, {res['machine'].get('cpu', '')}, kvrelay {res['machine']['kvrelay_git']}",
        f"load: before `{res['uptime_before']}`, after `{res['uptime_after']}`",
        f"calibration (one server, {res['args']['core_quota']:g} core each): prefill "
        f"{m['prefill_tok_s']:.0f} tok/s, decode {m['decode_tok_s']:.1f} tok/s at batch "
        f"{m['decode_batch']}, ITL at batch 1 {m['itl_at_1_ms']:.1f} ms, hand-off "
        f"{res['calibration']['handoff_ms']:.0f} ms",
        f"workload: {t['rate']:.3f} req/s Poisson, {t['prompt_len']} + {t['output_len']} tokens; "
        f"targets: mean TTFT <= {t['ttft_ms']:.0f} ms, mean ITL <= {t['itl_ms']:.1f} ms",
        f"`{res['plan_command']}` -> {res['recommended']}", "",
        *(f"round {i + 1}:\n\n{r['table']}\n\n{r['verdict']}\n" for i, r in
          enumerate(res["rounds"]))])


if __name__ == "__main__":
    main()
