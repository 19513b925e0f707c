"""The proxy's routing policies, measured: cache_aware vs round_robin, auto vs always.

    python benchmarks/routing.py [--part prefix|disagg|all] [--model DIR] [--out benchmarks/results]

Part `prefix` (4 prefills + 1 decode): for each of round_robin and cache_aware, a fresh
`kvrelay deploy --prefill 4 --decode 1` (empty prefix caches), a `kvrelay proxy --routing
POLICY` in front of its servers, then two `kvrelay bench serve` runs one after the other:
ShareGPT multi-turn (each turn's prompt is the whole conversation so far) and
prefix_repetition (a few shared prefixes). Reported: the prefill servers' prefix-cache hit
rate (hits / queries, from their /metrics, before and after each run), TTFT p50/p99 and
output throughput.

Part `disagg` (1 prefill + 1 decode): for each of always and auto, a fresh 1P1D and two
concurrent bench clients: 30 % short prompts (--short-input tokens) and 70 % long ones
(--long-input), Poisson arrivals. Reported: the short prompts' TTFT p50/p99 and the long
prompts' ITL p50/p99.

Part `crossover` (1P1D, idle): lone requests of a few prompt lengths through `always` and
`never`; the hand-off cost and the decode server's prefill speed give the default
`--direct-max-tokens` (see part_crossover).

Part `events` (2 prefills publishing KV events + 1 decode): cache_aware routing from the
servers' KV events (`--kv-events-port`) vs the proxy's own guess, where the guess goes
wrong: two proxies in front of the same servers (replicas behind a balancer), each seeing
half the traffic. See part_events.

Everything runs on this machine's cores (shared), so only ratios from the same run mean
anything; `uptime` is recorded before and after each part.
"""
from __future__ import annotations

import argparse
import json
import os
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
SERVED = "bench"


def uptime() -> str:
    return subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()


def stop(proc: subprocess.Popen, timeout_s: float = 90) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def deploy(model: str, prefill: int, base_port: int, work: Path, args: argparse.Namespace,
           name: str) -> subprocess.Popen:
    cmd = [PY, "-m", "kvrelay.cli", "deploy", "--model", model, "--prefill", str(prefill),
           "--decode", "1", "--devices", "0-1", "--base-port", str(base_port), "--no-validate",
           "--served-model-name", SERVED, "--log-dir", str(work / f"{name}-logs"), "--",
           "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs)]
    log(f"{name}: {' '.join(cmd[3:])}")
    out = work / f"{name}-deploy.log"
    proc = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    deadline = time.monotonic() + 1200
    while "OpenAI base URL" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"deploy did not come up:\n{out.read_text()[-2000:]}")
        time.sleep(1)
    return proc


def proxy(port: int, prefill_ports: list[int], decode_port: int, flags: list[str], work: Path,
          name: str) -> subprocess.Popen:
    cmd = [PY, "-m", "kvrelay.cli", "proxy", "--port", str(port), "--log-level", "info",
           "--prefiller-port", *map(str, prefill_ports), "--decoder-port", str(decode_port), *flags]
    out = work / f"{name}-proxy.log"
    proc = subprocess.Popen(cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while "Application startup complete" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"proxy did not start:\n{out.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def counters(ports: list[int]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out = {"queries": 0.0, "hits": 0.0, "prompt_tokens": 0.0}
    names = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vllm:prompt_tokens_total": "prompt_tokens"}
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in names:
                    out[names[s.name]] += s.value
    return out


def bench(url: str, name: str, work: Path, model: str, extra: list[str]) -> subprocess.Popen:
    cmd = [PY, "-m", "kvrelay.cli", "bench", "serve", "--base-url", url, "--model", SERVED,
           "--tokenizer", model, "--seed", "0", "--disable-tqdm", "--ignore-eos",
           "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--no-plot", "--result-dir", str(work), "--result-filename",
           f"{name}.json", *extra]
    return subprocess.Popen(cmd, stdout=open(work / f"{name}.log", "w"),
                            stderr=subprocess.STDOUT)


def summary(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return {k: data.get(k) for k in ("completed", "failed", "duration", "request_throughput",
                                     "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                     "median_itl_ms", "p99_itl_ms")}


PREFIX_WORKLOADS = {       # sized for 2 shared cores: short outputs, prompts <= 512 tokens
    "sharegpt_multi_turn": ["--dataset-name", "sharegpt", "--sharegpt-multi-turn",
                            "--sharegpt-max-turns", "4", "--sharegpt-output-len", "8",
                            "--sharegpt-max-prompt-len", "512"],
    # longer conversations: more of each turn's prompt is the previous turn's prompt
    "sharegpt_multi_turn_long": ["--dataset-name", "sharegpt", "--sharegpt-multi-turn",
                                 "--sharegpt-max-turns", "8", "--sharegpt-output-len", "8",
                                 "--sharegpt-max-prompt-len", "1536"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition",
                          "--prefix-repetition-prefix-len", "256",
                          "--prefix-repetition-suffix-len", "16",
                          "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "8"],
}


def part_prefix(model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"uptime_before": uptime()}
    base = args.base_port
    prefills, decode = [base + 100 + i for i in range(4)], base + 200
    for routing in args.routings:
        dep = deploy(model, 4, base, work, args, f"prefix-{routing}")
        px = None
        try:
            px = proxy(base + 50, prefills, decode, ["--routing", routing], work, routing)
            url = f"http://127.0.0.1:{base + 50}"
            for wl in args.workloads:
                flags = PREFIX_WORKLOADS[wl]
                before = counters(prefills)
                name = f"{wl}-{routing}"
                b = bench(url, name, work, model, [*flags, "--num-prompts",
                                                   str(args.prefix_prompts),
                                                   "--request-rate", str(args.prefix_rate)])
                if b.wait(args.timeout) != 0:
                    raise RuntimeError(f"bench failed: {work / name}.log")
                after = counters(prefills)
                q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
                res[name] = summary(work / f"{name}.json") | {
                    "prefill_prefix_queries": q, "prefill_prefix_hits": h,
                    "prefill_hit_rate": h / q if q else 0.0,
                    "prefill_prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"]}
                log(f"{name}: {res[name]}")
        finally:
            if px is not None:
                stop(px, 20)
            stop(dep)
    res["uptime_after"] = uptime()
    return res


def part_disagg(model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"uptime_before": uptime()}
    base = args.base_port
    n_short = round(args.mix_prompts * 0.3)
    n_long = args.mix_prompts - n_short
    for policy in ("always", "auto"):
        dep = deploy(model, 1, base, work, args, f"disagg-{policy}")
        px = None
        try:
            px = proxy(base + 50, [base + 100], base + 200, ["--disagg-policy", policy], work,
                       policy)
            url = f"http://127.0.0.1:{base + 50}"
            short = bench(url, f"short-{policy}", work, model, [
                "--dataset-name", "random", "--random-input-len", str(args.short_input),
                "--random-output-len", str(args.mix_output), "--num-prompts", str(n_short),
                "--request-rate", str(args.mix_rate * 0.3), "--seed", "1"])
            long = bench(url, f"long-{policy}", work, model, [
                "--dataset-name", "random", "--random-input-len", str(args.long_input),
                "--random-output-len", str(args.mix_output), "--num-prompts", str(n_long),
                "--request-rate", str(args.mix_rate * 0.7), "--seed", "2"])
            for p in (short, long):
                if p.wait(args.timeout) != 0:
                    raise RuntimeError(f"bench failed; see {work}")
            res[policy] = {"short": summary(work / f"short-{policy}.json"),
                           "long": summary(work / f"long-{policy}.json")}
            log(f"{policy}: {res[policy]}")
        finally:
            if px is not None:
                stop(px, 20)
            stop(dep)
    res["uptime_after"] = uptime()
    return res


def first_token_s(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of a 2-token completion of `prompt` (token ids)."""
    t0 = time.perf_counter()
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError(f"no token from {url}")


def part_crossover(model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The default --direct-max-tokens, measured: on an idle 1P1D, TTFT of lone requests of
    L tokens through prefill → decode (`always`) and straight to decode (`never`).
    H = TTFT_always - TTFT_never (the hand-off: a prefill round trip, KV transfer, a second
    hop), P = the decode server's prefill tokens/s (slope of TTFT_never over L). A prompt
    with L <= H·P prefills on the decode server in no more time than the hand-off alone
    costs: that is the threshold."""
    import random
    import statistics
    res: dict[str, Any] = {"uptime_before": uptime()}
    base = args.base_port
    dep = deploy(model, 1, base, work, args, "crossover")
    pxs: list[subprocess.Popen] = []
    try:
        urls = {}
        for i, policy in enumerate(("always", "never")):
            pxs.append(proxy(base + 50 + i, [base + 100], base + 200,
                             ["--disagg-policy", policy], work, f"crossover-{policy}"))
            urls[policy] = f"http://127.0.0.1:{base + 50 + i}"
        rng = random.Random(0)
        table: dict[int, dict[str, float]] = {}
        for n in args.crossover_lens:
            row: dict[str, list[float]] = {"always": [], "never": []}
            for _ in range(args.crossover_reps):
                for policy in ("always", "never"):     # fresh prompts: no prefix-cache hits
                    prompt = [rng.randrange(1000, 40000) for _ in range(n)]
                    row[policy].append(first_token_s(urls[policy], prompt))
            table[n] = {p: statistics.median(v) * 1e3 for p, v in row.items()}
            log(f"crossover L={n}: {table[n]}")
        lens = sorted(table)
        lo, hi = lens[0], lens[-1]
        slope_ms = (table[hi]["never"] - table[lo]["never"]) / (hi - lo)
        handoff_ms = statistics.median(table[n]["always"] - table[n]["never"] for n in lens)
        res |= {"ttft_ms": table, "decode_prefill_tok_s": 1e3 / slope_ms if slope_ms > 0 else None,
                "handoff_ms": handoff_ms,
                "threshold_tokens": handoff_ms / slope_ms if slope_ms > 0 else None}
    finally:
        for px in pxs:
            stop(px, 20)
        stop(dep)
    res["uptime_after"] = uptime()
    return res


def serve(model: str, role: str, port: int, events: tuple[int, int], work: Path,
          args: argparse.Namespace) -> subprocess.Popen:
    """One `kvrelay serve` of a 1+ P 1 D topology (NIXL over UCX on loopback) publishing its
    KV events on 127.0.0.1 (`events`: PUB and replay ports)."""
    kv = {"kv_connector": "NixlConnector", "kv_role": role,
          "kv_connector_extra_config": {"backends": ["UCX"]}}
    ev = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events[0]}",
          "bind": True, "replay_endpoint": f"tcp://127.0.0.1:{events[1]}"}
    cmd = [PY, "-m", "kvrelay.cli", "serve", model, "--port", str(port), "--served-model-name",
           SERVED, "--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(ev)]
    env = os.environ | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 1000), "UCX_TLS": "tcp",
                        "UCX_NET_DEVICES": "lo"}
    return subprocess.Popen(cmd, stdout=open(work / f"serve-{port}.log", "w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server on {port} not healthy within {timeout_s:.0f} s")


def part_events(model: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """KV events vs the proxy's own guess. 2 prefill servers (publishing KV events) + 1
    decode, and four proxies, all cache_aware: two follow the prefills' events, two use
    their own guess. Each pair stands for two proxy replicas behind a balancer: request j of
    a mode uses prefix j % P and goes through proxy (j // P) % 2 of its pair, so every
    prefix reaches the servers through both proxies in turn, and a guessing proxy never saw
    what its twin routed (and the second proxy of each pair first takes one unrelated
    request: replicas' rotations are not in step). Each mode has its own prefixes (random
    token ids: exact blocks); the two modes' requests alternate (drift in the shared
    machine's load hits both), one at a time, so each request's prefill prefix-cache hits
    are the prefill servers' counter deltas around it. Reported per mode: hit rate (hits /
    queries, prefill servers), TTFT (streamed first token through the proxy) p50 and mean."""
    import random
    import statistics
    res: dict[str, Any] = {"uptime_before": uptime()}
    base = args.base_port
    prefills, decode = [base + 100, base + 101], base + 200
    events = [(base + 300 + 2 * i, base + 301 + 2 * i) for i in range(2)]
    servers = [serve(model, "kv_producer", p, ev, work, args) for p, ev in zip(prefills, events)]
    servers.append(serve(model, "kv_consumer", decode, (base + 310, base + 311), work, args))
    pxs: list[subprocess.Popen] = []
    try:
        for port in prefills + [decode]:
            wait_healthy(port)
        urls: dict[str, list[str]] = {"guess": [], "events": []}
        ev_flags = ["--kv-events-port", *(str(p) for p, _ in events),
                    "--kv-events-replay-port", *(str(r) for _, r in events)]
        for i, (mode, flags) in enumerate([("guess", []), ("guess", []), ("events", ev_flags),
                                           ("events", ev_flags)]):
            pxs.append(proxy(base + 50 + i, prefills, decode, flags, work, f"events-{mode}-{i}"))
            urls[mode].append(f"http://127.0.0.1:{base + 50 + i}")
        rng = random.Random(0)
        for port in prefills:                                # warm-up, not measured
            first_token_s(f"http://127.0.0.1:{port}", [rng.randrange(1000, 40000)
                                                       for _ in range(64)])
        for mode in urls:          # a replica's rotation is where its own traffic left it:
            first_token_s(urls[mode][1], [rng.randrange(1000, 40000) for _ in range(64)])
        n_prefixes, per_mode = args.events_prefixes, args.events_requests
        prefixes = {mode: [[rng.randrange(1000, 40000) for _ in range(args.events_prefix_len)]
                           for _ in range(n_prefixes)] for mode in urls}
        rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in urls}
        for j in range(per_mode):
            for mode in ("guess", "events"):
                prompt = prefixes[mode][j % n_prefixes] + [rng.randrange(1000, 40000)
                                                           for _ in range(16)]
                before = counters(prefills)
                ttft = first_token_s(urls[mode][(j // n_prefixes) % 2], prompt)
                time.sleep(0.3)                               # the prefill's counters settle
                after = counters(prefills)
                rows[mode].append({"ttft_s": ttft, "hits": after["hits"] - before["hits"],
                                   "queries": after["queries"] - before["queries"]})
        for mode, rs in rows.items():
            q, h = sum(r["queries"] for r in rs), sum(r["hits"] for r in rs)
            ttfts = [r["ttft_s"] * 1e3 for r in rs]
            res[mode] = {"requests": len(rs), "prefill_prefix_queries": q,
                         "prefill_prefix_hits": h, "prefill_hit_rate": h / q if q else 0.0,
                         "ttft_p50_ms": statistics.median(ttfts),
                         "ttft_mean_ms": statistics.fmean(ttfts),
                         "misses": sum(1 for r in rs if r["hits"] == 0)}
            log(f"events part, {mode}: {res[mode]}")
    finally:
        for px in pxs:
            stop(px, 20)
        for s in servers:
            stop(s)
    res["uptime_after"] = uptime()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("prefix", "disagg", "crossover", "events", "all"),
                    default="all")
    ap.add_argument("--routings", nargs="+", choices=("round_robin", "cache_aware"),
                    default=["round_robin", "cache_aware"], help="prefix part: in this order")
    ap.add_argument("--workloads", nargs="+", choices=tuple(PREFIX_WORKLOADS),
                    default=list(PREFIX_WORKLOADS), help="prefix part: these workloads")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument("--crossover-lens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--crossover-reps", type=int, default=3)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the embedded model)")
    ap.add_argument("--base-port", type=int, default=8400)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--prefix-prompts", type=int, default=16)
    ap.add_argument("--prefix-rate", type=float, default=0.1)
    ap.add_argument("--mix-prompts", type=int, default=30)
    ap.add_argument("--mix-rate", type=float, default=0.5)
    ap.add_argument("--short-input", type=int, default=32)
    ap.add_argument("--long-input", type=int, default=512)
    ap.add_argument("--mix-output", type=int, default=32)
    ap.add_argument("--events-prefixes", type=int, default=4)
    ap.add_argument("--events-prefix-len", type=int, default=256)
    ap.add_argument("--events-requests", type=int, default=24, help="per mode")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if args.model is None:
        from kvrelay.model.embedded import embedded_model_dir
        args.model = str(embedded_model_dir())
    work = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    log(f"work dir {work}")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "machine": machine_info() | {"kvrelay_git": git_sha()},
                               "args": {k: v for k, v in vars(args).items() if k != "out"}}
    if args.part in ("prefix", "all"):
        results["prefix"] = part_prefix(args.model, work, args)
    if args.part in ("disagg", "all"):
        results["disagg"] = part_disagg(args.model, work, args)
    if args.part in ("crossover", "all"):
        results["crossover"] = part_crossover(args.model, work, args)
    if args.part in ("events", "all"):
        results["events"] = part_events(args.model, work, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"routing-{args.part}{args.tag}.json"
    dest.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    log(f"results in {dest}")


if __name__ == "__main__":
    main()
