"""Expert parallelism across data-parallel replicas (EP = TP × DP), the tutorial's decode
layout (TP8 DP8 EP64) in small: -dp 2 (EP 2) and -tp 2 -dp 2 (EP 4) on the tiny
checkpoint's 4 experts. Replicas step in lockstep; an idle one runs dummy steps.

One server per layout for the module (a start is most of each test's time): the idle check
runs on the EP 2 server after its workload, and the killed-worker test, which ends its
server, is the EP 4 server's last user."""
from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from tests.factories import greedy_mismatch
from tests.processes import Server

PROMPTS = [[5, 17, 29, 40], [100, 101, 7], list(range(20, 45)), [9, 9, 9, 9, 9, 1], [61, 2, 88]]
MAX_TOKENS = 8
BASE = ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4"]
LAYOUT_LINE = re.compile(r"expert parallel: rank (\d+) \(replica (\d+), tp rank (\d+)\) holds "
                         r"experts \[(\d+), (\d+)\) of each layer, (\d+) bytes")


@pytest.fixture(scope="module")
def tp1_tokens(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    try:
        outs = llm.generate(PROMPTS,
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def ask(url: str, prompt: list[int]) -> list[str]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def run_workload(url: str) -> list[list[str]]:
    """Three requests at once, then two one after the other: the replicas are busy
    together, then one of them is idle while the other decodes (dummy steps)."""
    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda p: ask(url, p), PROMPTS[:3]))
    return first + [ask(url, p) for p in PROMPTS[3:]]


def check_tokens(tiny, got: list[list[str]], want: list[list[int]]) -> None:
    for prompt, words, ref in zip(PROMPTS, got, want):
        ids = [int(w.removeprefix("w")) for w in words]         # the word tokenizer: "w34" is id 34
        if ids != ref:   # only a near-tie may separate them (the brief's rule)
            assert greedy_mismatch(tiny[1], prompt, ids) is None, (prompt, ids, ref)


def check_layout(log: str, ranks: int, experts: int = 4) -> None:
    rows = [tuple(int(x) for x in m) for m in LAYOUT_LINE.findall(log)]
    assert sorted(r[0] for r in rows) == list(range(ranks)), log[-2000:]
    per = experts // ranks
    held = sorted((r[3], r[4]) for r in rows)
    assert held == [(i * per, (i + 1) * per) for i in range(ranks)]      # disjoint, covering all
    assert len({r[5] for r in rows}) == 1                                  # equal shares of bytes


def _serve(tiny, tmp_path_factory, tp: int, dp: int):
    s = Server(str(tiny[0]), BASE + ["-tp", str(tp), "-dp", str(dp), "--enable-expert-parallel"],
               tmp_path_factory.mktemp(f"ep-tp{tp}-dp{dp}") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def ep2(tiny, tmp_path_factory):
    """-dp 2 --enable-expert-parallel (EP 2)."""
    yield from _serve(tiny, tmp_path_factory, 1, 2)


@pytest.fixture(scope="module")
def ep4(tiny, tmp_path_factory):
    """-tp 2 -dp 2 --enable-expert-parallel (EP 4); test_killed_worker_... ends it."""
    yield from _serve(tiny, tmp_path_factory, 2, 2)


@pytest.mark.parametrize("layout,tp,dp", [("ep2", 1, 2), ("ep4", 2, 2)])
def test_experts_across_replicas_match_tp1(tiny, tp1_tokens, request, layout, tp, dp):
    s = request.getfixturevalue(layout)
    check_layout(s.log(), tp * dp)
    check_tokens(tiny, run_workload(s.url), tp1_tokens)
    m = s.metrics()
    assert m["kvrelay:dp_dummy_steps_total"] > 0          # an idle replica stepped along
    assert m["kvrelay:kv_blocks_used"] == 0
    assert s.log().count("steps in lockstep") == dp


def test_idle_replicas_do_not_spin(ep2):
    """With no work, the engine cores sleep on their pipes: almost no CPU time."""
    from tests.processes import descendants
    ask(ep2.url, PROMPTS[0])
    procs = descendants(ep2.proc.pid)

    def cpu_ticks() -> int:
        total = 0
        for p in procs:
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                pass
        return total

    before = cpu_ticks()
    time.sleep(3)
    assert cpu_ticks() - before < 30            # < 10% of one core over 3 s, for all processes


def test_killed_worker_of_one_replica_stops_everything(ep4):
    from tests.processes import alive, descendants
    s = ep4
    family = descendants(s.proc.pid)
    workers = [p for p in family if "kvrelay-tp-rank" in _name(p) or _is_worker(p, s.proc.pid)]
    assert workers, family
    result = {}

    def long_request():
        result["r"] = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "prompt": [1, 2, 3], "max_tokens": 80, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    import os
    import signal
    os.kill(workers[-1], signal.SIGKILL)           # a TP worker of one replica
    t.join(60)
    assert result["r"].status_code == 503
    assert s.proc.wait(60) == 1
    deadline = time.monotonic() + 20
    while any(alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if alive(p)], "orphan processes left behind"


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def _is_worker(pid: int, server_pid: int) -> bool:
    """A TP worker is a grandchild of the server (server → engine core → worker)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        return ppid != server_pid and "spawn_main" in _name(pid)
    except OSError:
        return False
