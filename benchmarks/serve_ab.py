#!/usr/bin/env python
"""Served tok/s of two (or more) kvrelay source trees on the same checkpoint, same load:
every tree's `kvrelay serve` runs at once (an idle server sleeps in poll(2)) and one
`kvrelay bench serve` client alternates between them, run by run (A B A B ...), with the
order of the trees reversed every other round.

    python benchmarks/serve_ab.py --trees base=/tmp/base,new=. [--model tiny-bf16|PATH]
        [--concurrency 1,8,64] [--rounds 3] [--num-prompts 64] [--input-len 200]
        [--output-len 64] [--env LABEL:K=V,K=V] [--autogroup-nice N] [--out FILE.json]

Each server: `serve MODEL --dtype bfloat16 --max-num-seqs 64 --max-model-len 4096` (the
flags of peers.py), its tree first on PYTHONPATH and as its working directory. Each run:
the tree's output tok/s, TTFT p50, ITL p50, and the CPU milliseconds per output token of
its API process and its engine core (from /proc), with `uptime` before it. Per tree and
concurrency the median over rounds, and each tree's ratio to the first tree. `--env
LABEL:K=V,...` (repeatable) adds environment variables to that tree's server (a tree may be
listed twice under two labels, e.g. to compare a setting). `--autogroup-nice -20` puts this
script (and so the client) and every server's scheduler autogroup (each server is a session
of its own) at that nice value: on a machine shared with other jobs, the runs then take the
cores first (Linux autogroups; needs the privilege to lower a nice value).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from serve_throughput import Server as _Server  # process-group handling
from serve_throughput import free_port

ROOT = Path(__file__).resolve().parent.parent


class TreeServer(_Server):
    def __init__(self, label: str, tree: Path, ckpt: Path, log_path: Path,
                 extra: list[str], extra_env: dict[str, str]) -> None:
        self.engine, self.port = label, free_port()
        env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=str(tree), **extra_env)
        self.cmd = [sys.executable, "-m", "kvrelay.cli", "serve", str(ckpt), "--host",
                    "127.0.0.1", "--port", str(self.port), "--served-model-name", "bench",
                    "--dtype", "bfloat16", "--max-num-seqs", "64", "--max-model-len", "4096",
                    *extra]
        self.log_file = open(log_path, "w")  # noqa: SIM115  (closed by stop())
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env=env, cwd=str(tree), start_new_session=True)
        self.pid = self.proc.pid


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[1]) == pid:
                out.append(int(d.name))
    return out


def core_pid(server: TreeServer) -> int | None:
    """The engine core: the API process's child with the most CPU time."""
    kids = children(server.pid)
    return max(kids, key=cpu_s) if kids else None


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True,
                          check=False).stdout.split("load average:")[-1].strip()


def bench(url: str, ckpt: Path, c: int, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvrelay.cli", "bench", "serve", "--base-url", url, "--model",
           "bench", "--tokenizer", str(ckpt), "--dataset-name", "random",
           "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
           "--num-prompts", str(a.num_prompts), "--max-concurrency", str(c), "--ignore-eos",
           "--seed", "0", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--no-plot", "--disable-tqdm"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=1800,
                       check=False)
    if r.returncode != 0:
        raise RuntimeError(f"bench failed: {(r.stderr + r.stdout)[-600:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", required=True, help="LABEL=PATH,LABEL=PATH")
    ap.add_argument("--model", default="tiny-bf16")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--serve-flags", default="", help="extra flags for every server")
    ap.add_argument("--env", action="append", default=[], metavar="LABEL:K=V,K=V")
    ap.add_argument("--autogroup-nice", type=int)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.trees.split(","))
    envs: dict[str, dict[str, str]] = {lab: {} for lab in trees}
    for spec in a.env:
        lab, _, pairs = spec.partition(":")
        envs[lab] |= dict(kv.split("=", 1) for kv in pairs.split(",") if kv)
    if a.model in ("tiny-bf16", "tiny-mxfp4"):
        from peers import tiny_checkpoint
        ckpt = tiny_checkpoint(mxfp4=a.model == "tiny-mxfp4")
    else:
        ckpt = Path(a.model)
    work = Path(tempfile.mkdtemp(prefix="kvrelay-ab-"))
    print(f"work dir {work}", flush=True)
    servers = {lab: TreeServer(lab, Path(p).resolve(), ckpt, work / f"{lab}.log",
                               a.serve_flags.split(), envs[lab]) for lab, p in trees.items()}
    runs: list[dict[str, Any]] = []
    if a.autogroup_nice is not None:
        for pid in (os.getpid(), *(s.pid for s in servers.values())):
            Path(f"/proc/{pid}/autogroup").write_text(str(a.autogroup_nice))
    try:
        for s in servers.values():
            print(f"{s.engine}: ready in {s.wait_ready(900):.0f} s", flush=True)
        conc = [int(c) for c in a.concurrency.split(",")]
        labels = list(servers)
        for r in range(a.rounds):
            order = labels if r % 2 == 0 else labels[::-1]
            for c in conc:
                for lab in order:
                    s = servers[lab]
                    core = core_pid(s)
                    load = uptime()
                    api0, core0 = cpu_s(s.pid), cpu_s(core) if core else 0.0
                    res = bench(s.url, ckpt, c, a, work / f"{lab}-r{r}-c{c}.json")
                    api1, core1 = cpu_s(s.pid), cpu_s(core) if core else 0.0
                    toks = max(1, res["total_output_tokens"])
                    row = {"tree": lab, "round": r, "c": c, "load": load,
                           "tok_s": res["output_throughput"],
                           "ttft_p50": res["median_ttft_ms"], "itl_p50": res["median_itl_ms"],
                           "api_cpu_ms_tok": 1e3 * (api1 - api0) / toks,
                           "core_cpu_ms_tok": 1e3 * (core1 - core0) / toks,
                           "failed": res.get("failed")}
                    runs.append(row)
                    print(f"r{r} c={c} {lab:>8}: {row['tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{row['ttft_p50']:6.1f} ms  ITL p50 {row['itl_p50']:6.2f} ms  CPU "
                          f"ms/tok api {row['api_cpu_ms_tok']:.3f} core "
                          f"{row['core_cpu_ms_tok']:.3f}  (load {load})", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print("\nmedians over rounds:")
    summary = {}
    for c in sorted({r["c"] for r in runs}):
        base = None
        for lab in servers:
            vals = [r["tok_s"] for r in runs if r["c"] == c and r["tree"] == lab]
            if not vals:
                continue
            med = statistics.median(vals)
            base = base or med
            summary[f"{lab}@c{c}"] = med
            print(f"c={c:<3} {lab:>8}: {med:7.1f} tok/s  (x{med / base:.3f} of the first; "
                  f"rounds {', '.join(f'{v:.0f}' for v in vals)})")
    if a.out:
        a.out.write_text(json.dumps({"trees": trees, "env": envs, "model": str(ckpt), "runs": runs,
                                     "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
