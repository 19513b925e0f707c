#!/usr/bin/env python
"""The part of a served token outside the engine step, for one or more source trees in
alternating rounds (same machine, same load: ratios between trees are what to quote).

    python benchmarks/serve_overhead.py [--trees A,B] [--rounds 2] [--concurrency 1,16]
        [--prompt-len 200] [--tokens 64] [--model PATH] [--fake-step-ms MS] [--out FILE.json]

Each tree (a checkout of kvrelay; default: this one) serves the model with
`kvrelay serve` (its own code on PYTHONPATH, KVRELAY_STEP_TRACE on), then its own
`kvrelay bench` client streams `/v1/completions` at each concurrency (greedy,
`ignore_eos`). Per concurrency it reports:

    tok/s, median ITL          the client's (output tokens over the run's wall time)
    step, period               the engine core's median step wall time and the median time
                               from one step's start to the next (KVRELAY_STEP_TRACE)
    ITL - step                 what a token spends outside the step (the API process, IPC,
                               SSE, the client, and the step slowed by their CPU)
    CPU ms per output token    the API process (event-loop thread and the others), the
                               engine core (all threads), the client (process time of the
                               run alone, not its start-up): on 2 cores, CPU the API process
                               or client burns can stall one of the engine's compute threads

--env 'LABEL:K=V,K=V' (repeatable) serves every tree once per such variant with those
environment variables (e.g. `--env spin:GOMP_SPINCOUNT=300000`); `--env base:` is the tree
as it is. --interleave starts every (tree, variant) server at once and alternates the
client between them run by run (an idle server sleeps in poll(2)): same-load ratios on a
machine whose load moves in minutes. --tokens/--requests size each run.

--fake-step-ms MS replaces the engine core by a stand-in that speaks the same protocol
(one `StepOutputs` per "step" of MS milliseconds of sleep, one token per running request,
the real engine core's delta shaping): the API process's and the client's CPU per token
without a model competing for the cores.
"""
from __future__ import annotations

import argparse
import json
import os
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

ROOT = Path(__file__).resolve().parent.parent

CLIENT = """
import asyncio, json, sys, time
from kvrelay.bench.client import RequestOptions
from kvrelay.bench.datasets import random_dataset
from kvrelay.bench.metrics import compute_metrics
from kvrelay.bench.runner import RunConfig, run
try:                                  # the tree's own client loop (older trees: asyncio's)
    from kvrelay.bench.runner import run_blocking
except ImportError:
    def run_blocking(cfg, convs):
        return asyncio.run(run(cfg, convs))
from kvrelay.bench.tokens import make_counter
url, tokenizer, n, prompt_len, tokens, c = sys.argv[1:7]
convs = random_dataset(make_counter(tokenizer), int(n), int(prompt_len), int(tokens))
cfg = RunConfig(url, RequestOptions("/v1/completions", "bench", True, 0.0),
                max_concurrency=int(c), disable_tqdm=True)
cpu0 = time.process_time()
outcome = run_blocking(cfg, convs)
cpu = time.process_time() - cpu0
m = compute_metrics(outcome.results, outcome.duration, [50])
print(json.dumps({"completed": m.completed, "failed": m.failed, "tokens": m.total_output,
                  "duration": outcome.duration, "tok_s": m.output_throughput,
                  "itl_ms": m.summaries["itl"].median, "tpot_ms": m.summaries["tpot"].median,
                  "ttft_ms": m.summaries["ttft"].median, "client_cpu_s": cpu}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid`, from the scheduler's exact run time
    (/proc/.../schedstat): utime/stime are sampled at clock ticks, which misses most of
    the short bursts a thread woken once per token runs."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if (int(f[1]) == pid and b"resource_tracker" not in cmd
                and b"compile_check" not in cmd):          # the grammar-check worker
            found.append(int(d.name))
    return found


class Server:
    def __init__(self, tree: Path, model: str, trace: Path, log: Path,
                 fake_step_ms: float | None = None, extra_env: dict[str, str] | None = None
                 ) -> None:
        self.port = free_port()
        self.trace = trace
        env = {**os.environ, **(extra_env or {}), "PYTHONPATH": str(tree),
               "KVRELAY_STEP_TRACE": str(trace)}
        self.log = open(log, "w")  # noqa: SIM115 -- closed by stop()
        cli = ["-m", "kvrelay.cli"]
        if fake_step_ms is not None:
            env["FAKE_STEP_S"] = str(fake_step_ms / 1e3)
            cli = [str(Path(__file__).resolve()), "fake-serve"]
        self.proc = subprocess.Popen(
            [sys.executable, *cli, "serve", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--served-model-name", "bench", "--dtype", "bfloat16",
             "--max-num-seqs", "64", "--max-model-len", "512"],
            env=env, cwd=tree, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 900) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("server not ready")

    @property
    def engine_pid(self) -> int:
        (pid,) = children(self.proc.pid)
        return pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_client(tree: Path, url: str, model: str, n: int, prompt_len: int, tokens: int,
               c: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CLIENT, url, model, str(n), str(prompt_len),
                          str(tokens), str(c)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def trace_lines(trace: Path) -> list[tuple[float, float, float, int]]:
    rows = []
    for line in trace.read_text().splitlines():
        a, b, c, n = line.split()
        rows.append((float(a), float(b), float(c), int(n)))
    return rows


def step_stats(rows: list[tuple[float, float, float, int]], c: int) -> dict[str, float]:
    """Median step and step-to-step period over the steps that produced `c` outputs (the
    steady state: every stream decoding), in ms."""
    steady = [i for i, r in enumerate(rows) if r[3] == c]
    steps = [1e3 * (rows[i][1] - rows[i][0]) for i in steady]
    periods = [1e3 * (rows[i + 1][0] - rows[i][0]) for i in steady
               if i + 1 < len(rows) and rows[i + 1][3] == c]
    sends = [1e3 * (rows[i][2] - rows[i][1]) for i in steady]
    return {"step_ms": statistics.median(steps) if steps else float("nan"),
            "period_ms": statistics.median(periods) if periods else float("nan"),
            "send_ms": statistics.median(sends) if sends else float("nan"),
            "steady_steps": len(steady)}


def measure_run(server: Server, tree: Path, model: str, c: int, prompt_len: int, tokens: int,
                n: int | None = None) -> dict[str, Any]:
    """One client run at concurrency `c` against a started server, with the core's step
    trace and the three processes' CPU over the run."""
    n = n or max(8, 2 * c)
    engine = server.engine_pid
    start = len(trace_lines(server.trace))
    api0, eng0 = thread_cpu(server.proc.pid), thread_cpu(engine)
    res = run_client(tree, server.url, model, n, prompt_len, tokens, c)
    api1, eng1 = thread_cpu(server.proc.pid), thread_cpu(engine)
    rows = trace_lines(server.trace)[start:]
    toks = max(1, res["tokens"])
    main_tid = server.proc.pid
    api_main = api1.get(main_tid, 0) - api0.get(main_tid, 0)
    api_all = sum(v - api0.get(t, 0) for t, v in api1.items())
    eng_all = sum(v - eng0.get(t, 0) for t, v in eng1.items())
    return res | step_stats(rows, c) | {
        "api_cpu_ms": 1e3 * api_all / toks,
        "api_loop_cpu_ms": 1e3 * api_main / toks,
        "engine_cpu_ms": 1e3 * eng_all / toks,
        "client_cpu_ms": 1e3 * res["client_cpu_s"] / toks}


def start_server(tree: Path, model: str, work: Path, fake_step_ms: float | None,
                 env: dict[str, str] | None = None, label: str = "") -> Server:
    stamp = f"{label.replace('/', '-')}-{time.monotonic_ns()}"
    server = Server(tree, model, work / f"trace-{stamp}.txt", work / f"server-{stamp}.log",
                    fake_step_ms, env)
    try:
        server.wait_ready()
        run_client(tree, server.url, model, 2, 64, 8, 1)            # warm-up
    except BaseException:
        server.stop()
        raise
    return server


def measure(tree: Path, model: str, concs: list[int], prompt_len: int, tokens: int,
            work: Path, fake_step_ms: float | None = None, env: dict[str, str] | None = None,
            n: int | None = None) -> dict[str, Any]:
    server = start_server(tree, model, work, fake_step_ms, env)
    try:
        return {str(c): measure_run(server, tree, model, c, prompt_len, tokens, n)
                for c in concs}
    finally:
        server.stop()


def parse_env(specs: list[str]) -> list[tuple[str, dict[str, str]]]:
    """--env 'LABEL:K=V,K=V' entries → (label, variables); none given: one plain variant."""
    variants = []
    for spec in specs or ["base:"]:
        label, _, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if a)
        variants.append((label or "base", env))
    return variants


def interleaved(configs: list[tuple[str, Path, dict[str, str]]], model: str, concs: list[int],
                a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Every config's server up at once; each round runs every config once per concurrency,
    in an order that alternates round by round."""
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        for label, tree, env in configs:
            servers.append(start_server(tree, model, work, a.fake_step_ms, env, label))
        order = list(range(len(configs)))
        for r in range(a.rounds):
            for c in concs:
                for i in order if r % 2 == 0 else order[::-1]:
                    label, tree, _ = configs[i]
                    load = os.getloadavg()[0]
                    m = measure_run(servers[i], tree, model, c, a.prompt_len, a.tokens,
                                    a.requests)
                    rows.append({"round": r, "tree": str(tree), "variant": label, "c": c,
                                 "load": load, **m})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for s in servers:
            s.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated kvrelay checkouts")
    ap.add_argument("--env", action="append", default=[],
                    help="a variant 'LABEL:K=V,K=V' of every tree (repeatable)")
    ap.add_argument("--interleave", action="store_true",
                    help="all servers up at once, client runs alternating between them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per run (default: max(8, 2 x concurrency))")
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--fake-step-ms", type=float, default=None,
                    help="a stand-in engine core whose steps sleep this long")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    configs = [(label if len(trees) == 1 else f"{tree.name}/{label}", tree, env)
               for tree in trees for label, env in parse_env(a.env)]
    concs = [int(c) for c in a.concurrency.split(",")]
    model = a.model
    if model is None:
        from kvrelay.model.embedded import embedded_model_dir
        model = str(embedded_model_dir())
    work = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    if a.interleave:
        rows = interleaved(configs, model, concs, a, work)
    else:
        rows = []
        for r in range(a.rounds):
            for label, tree, env in configs if r % 2 == 0 else configs[::-1]:
                load = os.getloadavg()[0]
                res = measure(tree, model, concs, a.prompt_len, a.tokens, work,
                              a.fake_step_ms, env, a.requests)
                for c, m in res.items():
                    rows.append({"round": r, "tree": str(tree), "variant": label, "c": int(c),
                                 "load": load, **m})
                    print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    print(summary(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| round | variant | c | load | tok/s | ITL ms | TPOT ms | step ms | period ms | "
            "ITL-step ms | API CPU ms/tok (loop) | engine CPU ms/tok | client CPU ms/tok |")
    lines = [head, "|" + "---|" * 13]
    for x in rows:
        lines.append(
            f"| {x['round']} | {x.get('variant', Path(x['tree']).name)} | {x['c']} | "
            f"{x['load']:.1f} | {x['tok_s']:.1f} | {x['itl_ms']:.2f} | {x['tpot_ms']:.2f} | "
            f"{x['step_ms']:.2f} | {x['period_ms']:.2f} | {x['itl_ms'] - x['step_ms']:.2f} | "
            f"{x['api_cpu_ms']:.3f} ({x['api_loop_cpu_ms']:.3f}) | {x['engine_cpu_ms']:.2f} | "
            f"{x['client_cpu_ms']:.3f} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per variant and concurrency: medians over the rounds."""
    keys = ("tok_s", "itl_ms", "tpot_ms", "step_ms", "period_ms", "api_cpu_ms",
            "engine_cpu_ms", "client_cpu_ms")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for x in rows:
        groups.setdefault((x.get("variant", Path(x["tree"]).name), x["c"]), []).append(x)
    lines = ["| variant | c | runs | " + " | ".join(keys) + " |", "|" + "---|" * (3 + len(keys))]
    for (label, c), xs in groups.items():
        vals = [f"{statistics.median(x[k] for x in xs):.3f}" for k in keys]
        lines.append(f"| {label} | {c} | {len(xs)} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


# -- the stand-in engine core (--fake-step-ms) ----------------------------------------------
def fake_core(args: Any, conn: Any, log_level: int = 0) -> None:
    """The engine core's protocol without a model: Ready, then per step (a sleep) one
    StepOutputs with one token for every running request, shaped by the real core's
    `_deltas`; stops on Shutdown."""
    from kvrelay.engine.codec import TO_ENGINE, MessagePipe
    from kvrelay.engine.core_proc import _deltas
    from kvrelay.engine.messages import (
        AbortRequests,
        AddRequest,
        EngineInfo,
        EngineStats,
        Ready,
        Shutdown,
        StepOutputs,
    )
    from kvrelay.engine.outputs import CompletionOutput, RequestOutput
    conn = MessagePipe(conn, TO_ENGINE)          # the engine core's end, in the codec
    step_s = float(os.environ["FAKE_STEP_S"])
    conn.send(Ready(EngineInfo(512, "fake", os.getpid(), 49152), EngineStats()))
    running: dict[str, tuple[list[int], int, list[int]]] = {}
    announced: set[str] = set()
    steps = 0
    trace = open(os.environ["KVRELAY_STEP_TRACE"], "a", buffering=1)  # noqa: SIM115
    while True:
        if not running:
            conn.poll(None)
        while conn.poll(0):
            m = conn.recv()
            if isinstance(m, Shutdown):
                return
            if isinstance(m, AddRequest):
                running[m.request_id] = (m.prompt, m.params.max_tokens or 16, [])
            elif isinstance(m, AbortRequests):
                for r in m.request_ids:
                    running.pop(r, None)
        if not running:
            continue
        started = time.monotonic()
        time.sleep(step_s)
        stepped = time.monotonic()
        outs = []
        for rid, (prompt, max_tokens, ids) in list(running.items()):
            ids.append(1000 + len(ids) % 97)
            done = len(ids) >= max_tokens
            c = CompletionOutput(0, " w" * len(ids), list(ids), "length" if done else None,
                                 None, None, " w", [ids[-1]])
            outs.append(RequestOutput(rid, None, prompt, [c], finished=done))
            if done:
                del running[rid]
        steps += 1
        conn.send(StepOutputs(_deltas(outs, announced),
                              EngineStats(num_requests_running=len(running), num_steps=steps)))
        trace.write(f"{started:.6f} {stepped:.6f} {time.monotonic():.6f} {len(outs)}\n")


def fake_serve(argv: list[str]) -> int:
    """`kvrelay serve` with `fake_core` as the engine-core process."""
    from kvrelay.cli import main as cli_main
    from kvrelay.engine import async_client
    async_client.run_engine_core = fake_core  # type: ignore[assignment]
    return cli_main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["fake-serve"]:
        sys.exit(fake_serve(sys.argv[2:]))
    main()
