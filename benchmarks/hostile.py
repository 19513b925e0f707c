"""A hostile battery against `kvrelay serve` and a 2P1D `kvrelay deploy` (issue 26's gate).

    python benchmarks/hostile.py [--base-port 8000] [--out benchmarks/results/hostile.json]

Two targets on one tiny harmony (o200k) checkpoint, one after the other: a single
`kvrelay serve`, then `kvrelay deploy --prefill 2 --decode 1` (NIXL, a generated KV secret)
with the bodies sent through its proxy and, for the KV-plane fields, straight to a prefill
and to the decode. Every body class of the issue, in several sizes each: grammar bombs on
every path (response_format, structured_outputs, guided_*, Responses text.format, tool
parameters under tool_choice required), choice and alternative floods, 1-31 MB prompts,
token-id lists, message and tool floods, 5,000-digit integers, truthy holds, relayed
`kv_transfer_params`, 25 MB metadata. Meanwhile one thread asks every server's `/health`
every 100 ms, another samples each server's RSS every 20 ms; an honest request follows each
group. Reported (and checked against the issue's targets): crashed processes (0), 5xx
answers (0), `/health` p99 (≤ 1 s), and for each body of 1 MB or more the largest RSS growth
of any server process while it was in flight ÷ its body size (≤ 2).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from common import git_sha, log, machine_info  # noqa: E402 -- after the sys.path insert
from disagg import stop, wait_health  # noqa: E402 -- the same process helpers

PY = sys.executable
MODEL = "hostile"
SERVE_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "8",
               "--served-model-name", MODEL, "--enable-auto-tool-choice",
               "--tool-call-parser", "openai"]
MB = 1 << 20


# ------------------------------------------------------------------ the bodies

def ref_chain(n: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def lark_chain(n: int) -> str:
    rules = [f"r{i}: \"a\" r{i + 1}" for i in range(n)]
    return "\n".join(["start: r0", *rules, f"r{n}: \"b\""])


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0"] + [f"r{i} ::= \"a\" r{i + 1}" for i in range(n)]
                     + [f"r{n} ::= \"b\""])


def alternatives(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n))


SCHEMAS = {f"ref{n}": ref_chain(n) for n in (600, 1200, 3000)} | {
    f"nest{n}": nested(n) for n in (100, 400)} | {
    "pattern bomb": {"type": "string", "pattern": "(a{1000}){1000}"}}
GRAMMARS = {f"lark{n}": lark_chain(n) for n in (1500, 3000, 10000)} | {
    f"gbnf{n}": gbnf_chain(n) for n in (1500, 5000)} | {
    f"alt{n}": alternatives(n) for n in (20000,)} | {
    "lark regex bomb": "start: /(a{1000}){1000}/"}
CHOICES = {"choices10k": [f"c{i}" for i in range(10_000)], "choice1M": ["x" * 1_000_000],
           "choices100k": [f"c{i}" for i in range(100_000)]}
USER = [{"role": "user", "content": "hi"}]


def schema_bodies() -> Iterator[tuple[str, str, Any]]:
    for name, schema in SCHEMAS.items():
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        yield f"completion response_format {name}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "response_format": rf}
        yield f"chat response_format {name}", "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4, "response_format": rf}
        yield f"chat structured_outputs {name}", "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4, "structured_outputs": {"json": schema}}
        yield f"completion guided_json {name}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "guided_json": schema}
        yield f"responses text.format {name}", "/v1/responses", {
            "input": "hi", "max_output_tokens": 4,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
        tool = {"type": "function", "name": "f", "parameters": schema}
        yield f"responses tool required {name}", "/v1/responses", {
            "input": "hi", "max_output_tokens": 4, "tools": [tool], "tool_choice": "required"}
        yield f"chat tool required {name}", "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}


def grammar_bodies() -> Iterator[tuple[str, str, Any]]:
    for name, grammar in GRAMMARS.items():
        yield f"completion guided_grammar {name}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "guided_grammar": grammar}
        yield f"chat structured_outputs.grammar {name}", "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4, "structured_outputs": {"grammar": grammar}}
        yield f"completion structured_outputs.grammar {name}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "structured_outputs": {"grammar": grammar}}
    for name, choice in CHOICES.items():
        yield f"completion guided_choice {name}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "guided_choice": choice}
        yield f"chat structured_outputs.choice {name}", "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4, "structured_outputs": {"choice": choice}}
    for n in (10_000, 100_000):
        yield f"regex alternation {n}", "/v1/completions", {
            "prompt": "a", "max_tokens": 4, "guided_regex": "|".join(f"w{i}" for i in range(n))}
    yield "regex nested groups", "/v1/completions", {
        "prompt": "a", "max_tokens": 4, "guided_regex": "(" * 5000 + "a" + ")" * 5000}
    yield "regex repetition bomb", "/v1/completions", {
        "prompt": "a", "max_tokens": 4, "guided_regex": "(a{1000}){1000}"}


def size_bodies() -> Iterator[tuple[str, str, Any]]:
    for mb in (1, 8, 31):
        text = "hello world " * (mb * MB // 12)
        yield f"prompt {mb} MB", "/v1/completions", {"prompt": text, "max_tokens": 1}
        yield f"chat message {mb} MB", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": text}], "max_tokens": 1}
        yield f"responses input {mb} MB", "/v1/responses", {"input": text, "max_output_tokens": 1}
    for mb in (1, 7):
        ids = [1] * (mb * MB // 2)
        yield f"token ids {mb} MB", "/v1/completions", {"prompt": ids, "max_tokens": 1}
        yield f"token id batch 4 x {mb} MB", "/v1/completions", {
            "prompt": [ids[: len(ids) // 4]] * 4, "max_tokens": 1}
    for n in (10_000, 200_000):
        yield f"{n} messages", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a"}] * n, "max_tokens": 1}
        tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}}
                 for i in range(n)]
        yield f"{n} tools", "/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                                                     "tools": tools}
    yield "metadata 25 MB", "/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                             "metadata": {"k": "v" * (25 * MB)}}
    yield "metadata 17 pairs", "/v1/responses", {"input": "hi", "max_output_tokens": 1,
                                                "metadata": {f"k{i}": "v" for i in range(17)}}


def raw_bodies() -> Iterator[tuple[str, str, bytes]]:
    digits = "1" * 5000
    for field in ("max_tokens", "seed", "n", "temperature", "top_k"):
        yield f"{field} of 5000 digits", "/v1/completions", (
            f'{{"model": "{MODEL}", "prompt": "a", "{field}": {digits}}}').encode()
    yield "token id of 5000 digits", "/v1/completions", (
        f'{{"model": "{MODEL}", "prompt": [{digits}]}}').encode()
    yield "logit_bias key of 5000 digits", "/v1/completions", (
        f'{{"model": "{MODEL}", "prompt": "a", "logit_bias": {{"{digits}": 1}}}}').encode()
    yield "deep JSON", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for n in (1000, 5000):            # deeper than Python's own encoder goes: written as text
        schema = '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n
        yield f"response_format nested {n}", "/v1/completions", (
            f'{{"model": "{MODEL}", "prompt": "a", "response_format": {{"type": "json_schema", '
            f'"json_schema": {{"name": "x", "schema": {schema}}}}}}}').encode()
    yield "NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}'


def kv_bodies(relay_port: int) -> Iterator[tuple[str, str, Any]]:
    for value in (1, "x", [1], {"a": 1}, 1.0):
        yield f"do_remote_decode {value!r}", "/v1/completions", {
            "prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": value}}
        yield f"do_remote_prefill {value!r}", "/v1/completions", {
            "prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_prefill": value}}
    forged = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
              "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1",
              "remote_port": relay_port, "remote_request_id": "r", "tp_size": 1,
              "remote_capability": "c" * 43}
    yield "relayed kv_transfer_params", "/v1/completions", {
        "prompt": "hello", "max_tokens": 1, "kv_transfer_params": forged}
    yield "relayed kv_transfer_params, bad mac", "/v1/completions", {
        "prompt": "hello", "max_tokens": 1, "kv_transfer_params": forged | {"remote_mac": "AA=="}}


def battery(relay_port: int, repeat: int) -> list[tuple[str, str, Any]]:
    bodies = [*schema_bodies(), *grammar_bodies(), *size_bodies(), *raw_bodies(),
              *kv_bodies(relay_port)]
    return bodies * repeat


# ------------------------------------------------------------------ watching the servers

def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_kind(pid: int) -> str:
    """"proxy", "api server", "engine" or "other", from the command line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "other"
    if " proxy" in cmd:
        return "proxy"
    if " serve" in cmd:
        return "api server"
    if "multiprocessing" in cmd or "spawn" in cmd:
        return "engine"
    return "other"


def tree_pids(root: int) -> list[int]:
    """`root` and every live descendant (deploy starts its servers in sessions of their own)."""
    from tests.processes import descendants
    return [root, *descendants(root)]


class Watch:
    """/health of every URL each 100 ms and the RSS of every process of the tree each 20 ms,
    sampled in a child process: in this one, building and sending 31 MB bodies holds the
    GIL for whole seconds, which a thread here would count as the servers' latency."""

    def __init__(self, urls: list[str], root: int) -> None:
        import multiprocessing
        self.urls = urls
        self.pids = tree_pids(root)
        self.kinds = {pid: process_kind(pid) for pid in self.pids}
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_sample, args=(urls, self.pids, self._stop, child),
                                 daemon=True)
        self.health: dict[str, list[float]] = {}
        self.health_failures: Counter[str] = Counter()
        self._rss: list[tuple[float, int, int]] = []       # (time, pid, bytes)

    def __enter__(self) -> Watch:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        health, failures, self._rss = self._parent.recv()
        self._proc.join()
        self.health, self.health_failures = health, Counter(failures)

    def growth(self, start: float, end: float) -> dict[str, int]:
        """Per kind of process (`process_kind`): the largest RSS growth of one of them
        while [start, end] (time.time()) lasted, over its last sample before `start`."""
        before: dict[int, int] = {}
        peak: dict[int, int] = {}
        for t, pid, value in self._rss:
            if t < start:
                before[pid] = value
            elif t <= end + 0.05 and pid in before:
                peak[pid] = max(peak.get(pid, 0), value)
        out: dict[str, int] = {}
        for pid in peak:
            kind = self.kinds.get(pid, "other")
            out[kind] = max(out.get(kind, 0), peak[pid] - before[pid])
        return out

    def dead(self) -> list[int]:
        return [pid for pid in self.pids if not Path(f"/proc/{pid}").exists()]


def _sample(urls: list[str], pids: list[int], stop: Any, conn: Any) -> None:
    health: dict[str, list[float]] = {url: [] for url in urls}
    failures: Counter[str] = Counter()
    rss_samples: list[tuple[float, int, int]] = []

    def poll_health() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                for url in urls:
                    t0 = time.perf_counter()
                    try:
                        status = str(client.get(f"{url}/health").status_code)
                    except httpx.HTTPError as e:
                        status = type(e).__name__
                    health[url].append(time.perf_counter() - t0)
                    if status != "200":
                        failures[status] += 1
                stop.wait(0.1)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    while not stop.is_set():
        now = time.time()
        rss_samples.extend((now, pid, rss(pid)) for pid in pids)
        stop.wait(0.02)
    poller.join()
    conn.send((health, dict(failures), rss_samples))


# ------------------------------------------------------------------ one target

def send(client: httpx.Client, url: str, path: str, body: Any) -> tuple[int | str, int]:
    if isinstance(body, bytes):
        data = body
    else:
        data = json.dumps({"model": MODEL, **body}).encode()
    try:
        r = client.post(url + path, content=data, headers={"Content-Type": "application/json"})
        return r.status_code, len(data)
    except httpx.HTTPError as e:
        return type(e).__name__, len(data)


def honest(client: httpx.Client, url: str) -> bool:
    r = client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "The capital",
                                                   "max_tokens": 4, "temperature": 0})
    return r.status_code == 200 and bool(r.json()["choices"][0]["text"] is not None)


def run_target(name: str, targets: dict[str, str], health_urls: list[str], root: int,
               bodies: list[tuple[str, str, Any]], kv_targets: dict[str, str]) -> dict[str, Any]:
    statuses: Counter[str] = Counter()
    fivexx: list[str] = []
    timed: list[tuple[str, int, float, float]] = []      # bodies >= 1 MB: label, size, times
    honest_failures = 0
    sent = 0
    with Watch(health_urls, root) as watch, httpx.Client(timeout=120) as client:
        for i, (label, path, body) in enumerate(bodies):
            is_kv = label.startswith(("do_remote", "relayed"))
            for tname, url in (kv_targets if is_kv else targets).items():
                t0 = time.time()
                status, size = send(client, url, path, body)
                t1 = time.time()
                sent += 1
                statuses[str(status)] += 1
                if not isinstance(status, int) or status >= 500:
                    fivexx.append(f"{tname}: {label} -> {status}")
                if size >= MB:
                    timed.append((f"{tname}: {label}", size, t0, t1))
            if i % 10 == 9:
                honest_failures += not honest(client, next(iter(targets.values())))
                log(f"{name}: {i + 1}/{len(bodies)} bodies, {len(fivexx)} x 5xx, "
                    f"{len(watch.dead())} dead")
        honest_failures += not honest(client, next(iter(targets.values())))
        dead = watch.dead()
    grown = [(label, watch.growth(t0, t1), size) for label, size, t0, t1 in timed]
    ratios = [(label, max(g.values(), default=0) / size) for label, g, size in grown]
    by_kind: dict[str, tuple[str, float]] = {}
    for label, g, size in grown:
        for kind, growth in g.items():
            if growth / size > by_kind.get(kind, ("-", 0.0))[1]:
                by_kind[kind] = (label, growth / size)
    health = sorted(t for times in watch.health.values() for t in times)
    per_url = {url: {"p99_s": sorted(times)[int(len(times) * 0.99)], "max_s": max(times)}
               for url, times in watch.health.items() if times}
    worst = max(ratios, key=lambda r: r[1], default=("-", 0.0))
    return {"bodies_sent": sent, "statuses": dict(statuses), "5xx": fivexx,
            "crashed_pids": dead, "honest_failures": honest_failures,
            "health_checks": len(health),
            "health_p50_s": health[len(health) // 2] if health else None,
            "health_p99_s": health[int(len(health) * 0.99)] if health else None,
            "health_max_s": health[-1] if health else None,
            "health_failures": dict(watch.health_failures), "health_per_url": per_url,
            "processes_watched": len(watch.pids),
            "rss_growth_per_body_byte_max": worst[1], "rss_worst_body": worst[0],
            "rss_growth_per_body_byte_by_process": by_kind,
            "rss_ratios": sorted(ratios, key=lambda r: -r[1])[:10]}


# ------------------------------------------------------------------ topologies

def checkpoint(work: Path) -> Path:
    from tests.factories import make_hf_model, save_checkpoint
    from tests.harmony_factories import GPT_OSS_VOCAB_SIZE, make_o200k_tokenizer_json
    path = work / "o200k-tiny"
    save_checkpoint(make_hf_model(seed=5, vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=32,
                                  head_dim=8, intermediate_size=64, num_local_experts=2,
                                  num_hidden_layers=2), path)
    make_o200k_tokenizer_json(path)
    return path


def start(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    out = open(log_path, "w")  # noqa: SIM115 -- lives as long as the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))


def relay_listener() -> tuple[int, list[int]]:
    """A listener where relayed params point: counts connections a decode made to it."""
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    hits: list[int] = []

    def accept() -> None:
        while True:
            conn, _ = sock.accept()
            hits.append(1)
            conn.close()
    threading.Thread(target=accept, daemon=True).start()
    return sock.getsockname()[1], hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-port", type=int, default=8000)
    ap.add_argument("--repeat", type=int, default=1, help="times the battery is sent")
    ap.add_argument("--only", choices=("serve", "deploy"), default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    model = str(checkpoint(work))
    relay_port, relay_hits = relay_listener()
    bodies = battery(relay_port, args.repeat)
    log(f"{len(bodies)} bodies per target; work dir {work}")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "git": git_sha(), "machine": machine_info(),
                              "bodies": len(bodies)}
    if args.only in (None, "serve"):
        url = f"http://127.0.0.1:{args.base_port}"
        proc = start([PY, "-m", "kvrelay.cli", "serve", model, "--port", str(args.base_port),
                      *SERVE_FLAGS], work / "serve.log")
        try:
            wait_health(url, proc)
            result["serve"] = run_target("serve", {"serve": url}, [url], proc.pid, bodies,
                                         {"serve": url})
        finally:
            stop(proc, timeout_s=90)
    if args.only in (None, "deploy"):
        base = args.base_port
        proxy, prefills = f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{base + 100 + i}"
                                                       for i in range(2)]
        decode = f"http://127.0.0.1:{base + 200}"
        proc = start([PY, "-m", "kvrelay.cli", "deploy", "--model", model, "--prefill", "2",
                      "--decode", "1", "--port", str(base), "--base-port", str(base),
                      "--no-validate",
                      "--served-model-name", MODEL, "--log-dir", str(work / "deploy-logs"),
                      "--", *[f for f in SERVE_FLAGS if f != MODEL
                              and f != "--served-model-name"]], work / "deploy.log")
        try:
            for server in (*prefills, decode, proxy):
                wait_health(server, proc)
            result["deploy"] = run_target(
                "2P1D", {"proxy": proxy}, [proxy, *prefills, decode], proc.pid, bodies,
                {"proxy": proxy, "prefill": prefills[0], "decode": decode})
        finally:
            stop(proc, timeout_s=90)
    result["relay_listener_connections"] = len(relay_hits)
    checks = {t: {"no_crash": not r["crashed_pids"], "no_5xx": not r["5xx"],
                  "health_p99_le_1s": (r["health_p99_s"] or 0) <= 1.0,
                  "rss_le_2x_body": r["rss_growth_per_body_byte_max"] <= 2.0}
              for t, r in result.items() if t in ("serve", "deploy")}
    result["checks"] = checks
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
