"""`kvrelay deploy` end to end: 2P1D of a tiny checkpoint on loopback (free ports), then
`kvrelay validate --expect-di` and a short `kvrelay bench serve` against its proxy, then
SIGINT: deploy exits 0 and leaves no process and no listening port behind."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.processes import alive, descendants

READY = "Ctrl-C stops everything."
OFFSETS = (0, 100, 101, 200)          # proxy, prefill-0, prefill-1, decode-0 from --base-port
SIDE_OFFSETS = (0, 1, 100)            # prefill-0, prefill-1, decode-0 from --side-channel-port


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_bases() -> tuple[int, int]:
    """--base-port and --side-channel-port whose derived ports are all free (never 8000)."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base, side = rng.randrange(20000, 30000), rng.randrange(30000, 40000)
        if all(_free(base + o) for o in OFFSETS) and all(_free(side + o) for o in SIDE_OFFSETS):
            return base, side
    raise RuntimeError("no free port block found")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _kvrelay(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *args], capture_output=True, text=True, check=False,
                          timeout=timeout)


@pytest.fixture(scope="module")
def deployment(tiny_no_eos, tmp_path_factory):
    logs = tmp_path_factory.mktemp("deploy")
    base, side = _free_bases()
    out_path = logs / "deploy.out"
    env = os.environ | {"UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "deploy", "--model", str(tiny_no_eos), "--prefill", "2", "--decode",
             "1", "--base-port", str(base), "--side-channel-port", str(side), "--log-dir", str(logs),
             "--validate-requests", "2", "--", "--dtype", "float32", "--max-model-len", "256", "--block-size", "4"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    info = {"proc": proc, "base": base, "side": side, "out": out_path, "url": f"http://127.0.0.1:{base}"}
    try:
        deadline = time.monotonic() + 150
        while READY not in out_path.read_text():
            assert proc.poll() is None, f"deploy exited with {proc.returncode}:\n{out_path.read_text()}"
            assert time.monotonic() < deadline, f"deploy not ready:\n{out_path.read_text()}"
            time.sleep(0.3)
        yield info
    finally:
        if proc.poll() is None:                     # a failed test before the SIGINT test
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                for pid in descendants(proc.pid) + [proc.pid]:
                    os.kill(pid, signal.SIGKILL)


def test_deploy_validated_its_own_topology(deployment):
    text = deployment["out"].read_text()
    for check in ("health", "models", "completion", "chat", "traffic", "kv-transfer"):
        assert f"validate: PASS {check}:" in text, text
    base, side = deployment["base"], deployment["side"]
    assert f"prefill-1  http://127.0.0.1:{base + 101}  TP1, devices 1  side channel {side + 1}" in text
    assert f"decode-0   http://127.0.0.1:{base + 200}" in text


def test_validate_expect_di_against_the_proxy(deployment):
    r = _kvrelay("validate", "--base-url", deployment["url"], "--expect-di", "--num-requests", "4", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:6]] == [
        "PASS health", "PASS models", "PASS completion", "PASS chat", "PASS traffic", "PASS kv-transfer"]
    assert lines[0] == "PASS health: HTTP 200 (2 prefill, 1 decode behind it)"


def test_bench_serve_against_the_proxy(deployment):
    pytest.importorskip("kvrelay.bench")
    r = _kvrelay("bench", "serve", "--disable-tqdm", "--base-url", deployment["url"], "--dataset-name", "random",
                 "--random-input-len", "12", "--random-output-len", "4", "--num-prompts", "4",
                 "--max-concurrency", "2", "--ignore-eos", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Failed requests:                        0" in r.stdout


def test_sigint_stops_everything(deployment):
    proc = deployment["proc"]
    children = descendants(proc.pid)
    assert len(children) >= 4                       # 3 servers (+ engine cores) and the proxy
    ports = [deployment["base"] + o for o in OFFSETS]
    side_channels = [deployment["side"] + o for o in SIDE_OFFSETS[:2]]      # the prefill servers listen
    assert all(_listening(p) for p in ports + side_channels)
    os.killpg(proc.pid, signal.SIGINT)              # deploy's own group: what Ctrl-C in its terminal does
    assert proc.wait(60) == 0, deployment["out"].read_text()
    text = deployment["out"].read_text()
    assert "SIGINT: stopping everything" in text and "stopped 4 process(es)" in text
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in children if alive(pid)] == []
    assert [p for p in ports + side_channels if _listening(p)] == []
