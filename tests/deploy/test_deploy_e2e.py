"""`kvrelay deploy` end to end: 2P1D of a tiny checkpoint on loopback (free ports), then
`kvrelay validate --expect-di` and a short `kvrelay bench serve` against its proxy, the KV
secret every server got, a killed prefill server restarted while the proxy routes around it,
then SIGINT: deploy exits 0, leaves no process and no listening port behind, and no server
logged an ERROR on the way out. `--no-restart`: one dead server stops everything."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
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
    """--base-port and --side-channel-port whose derived ports are all free (never 8000),
    below Linux's ephemeral range (32768-60999): a port there can be taken by any outgoing
    connection between this check and the server's bind (a side channel drawn at 39065
    once found its port in use)."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base, side = rng.randrange(20000, 32000), rng.randrange(10000, 19800)
        if all(_free(base + o) for o in OFFSETS) and all(_free(side + o) for o in SIDE_OFFSETS):
            return base, side
    raise RuntimeError("no free port block found")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _await_proxy_sees_healthy(c: httpx.Client, role: str, deadline: float) -> None:
    """Deploy says "ready again" when the server answers; the proxy learns it at its next
    background /health probe (every 2 s): wait for that before counting on its turns."""
    while True:
        lines = [line for line in c.get("/metrics").text.splitlines()
                 if line.startswith("kvrelay_proxy:backend_healthy") and f'role="{role}"' in line]
        if lines and all(float(line.split()[-1]) == 1.0 for line in lines):
            return
        assert time.monotonic() < deadline, lines
        time.sleep(0.2)


def _served_prompt_tokens(metrics_url: str) -> float:
    text = httpx.get(metrics_url).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def _kvrelay(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *args], capture_output=True,
                          text=True, check=False, timeout=timeout)


@pytest.fixture(scope="module")
def deployment(tiny_no_eos, tmp_path_factory):
    logs = tmp_path_factory.mktemp("deploy")
    base, side = _free_bases()
    out_path = logs / "deploy.out"
    env = os.environ | {"UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "deploy", "--model", str(tiny_no_eos),
             "--prefill", "2", "--decode", "1", "--port", str(base), "--base-port", str(base),
             "--side-channel-port", str(side), "--log-dir", str(logs), "--validate-requests", "2",
             "--", "--dtype", "float32", "--max-model-len", "256", "--block-size", "4"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    info = {"proc": proc, "base": base, "side": side, "out": out_path,
            "url": f"http://127.0.0.1:{base}"}
    try:
        deadline = time.monotonic() + 150
        while READY not in out_path.read_text():
            assert proc.poll() is None, (f"deploy exited with {proc.returncode}:\n"
                                         f"{out_path.read_text()}")
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
    assert (f"prefill-1  http://127.0.0.1:{base + 101}  TP1, devices 1  "
            f"side channel {side + 1}") in text
    assert f"decode-0   http://127.0.0.1:{base + 200}" in text
    for name in ("decode-0", "prefill-0", "prefill-1", "proxy"):      # the bring-up status
        assert f"kvrelay deploy: {name}: ready (" in text, text


def test_validate_expect_di_against_the_proxy(deployment):
    r = _kvrelay("validate", "--base-url", deployment["url"], "--expect-di", "--num-requests", "4",
                 timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:6]] == [
        "PASS health", "PASS models", "PASS completion", "PASS chat", "PASS traffic",
        "PASS kv-transfer"]
    assert lines[0] == "PASS health: HTTP 200 (2 prefill, 1 decode behind it)"


def test_bench_serve_against_the_proxy(deployment):
    pytest.importorskip("kvrelay.bench")
    r = _kvrelay("bench", "serve", "--disable-tqdm", "--base-url", deployment["url"],
                 "--dataset-name", "random",
                 "--random-input-len", "12", "--random-output-len", "4", "--num-prompts", "4",
                 "--max-concurrency", "2", "--ignore-eos", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Failed requests:                        0" in r.stdout


def _started_pids(text: str) -> dict[str, int]:
    """{name: pid} from deploy's "started decode-0 (pid 1), prefill-0 (pid 2), …" lines."""
    pids = {}
    for line in text.splitlines():
        if line.startswith(("kvrelay deploy: started ", "kvrelay deploy: restarted ")):
            for part in line.split(" ", 3)[3].split(", "):
                name, _, pid = part.partition(" (pid ")
                pids[name] = int(pid.rstrip(")"))
    return pids


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def test_every_server_gets_one_kv_secret_shown_nowhere(deployment):
    pids = _started_pids(deployment["out"].read_text())
    servers = [n for n in pids if n != "proxy"]
    assert sorted(servers) == ["decode-0", "prefill-0", "prefill-1"]
    secrets = {_environ(pids[n]).get("KVRELAY_KV_SECRET") for n in servers}
    assert len(secrets) == 1
    secret = secrets.pop()
    assert secret is not None and len(secret) == 64 and int(secret, 16) >= 0
    shown = [deployment["out"]] + sorted(deployment["out"].parent.glob("*.log"))
    assert [str(f) for f in shown if secret in f.read_text(errors="replace")] == []
    for pid in pids.values():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret.encode() not in f.read()
    assert "in every server's KVRELAY_KV_SECRET (not shown)" in deployment["out"].read_text()


def test_a_killed_server_is_restarted_while_the_proxy_routes_around_it(deployment):
    out = deployment["out"]
    old = _started_pids(out.read_text())["prefill-0"]
    os.killpg(old, signal.SIGKILL)                  # the server and its engine core
    body = {"prompt": "w5 w17 w29", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=deployment["url"], timeout=60, trust_env=False) as c:
        # gone: its listener closed too. The leader turns zombie (alive() False) while its
        # other threads still exit, and until the last one has, the port takes connections
        # that the closing listener then resets: a request routed there in that moment was
        # taken, so the proxy (by design) does not send it elsewhere.
        while alive(old) or _listening(deployment["base"] + OFFSETS[1]):
            time.sleep(0.05)
        for _ in range(4):  # round-robin meets the dead one: retried elsewhere
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 150
        while "prefill-0 is ready again" not in out.read_text():
            assert deployment["proc"].poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.3)
        text = out.read_text()
        assert (f"prefill-0 (pid {old}) exited with status -9; restarting it in 1s "
                "(restart 1") in text
        new = _started_pids(text)["prefill-0"]
        assert new != old and alive(new)
        sibling = _started_pids(text)["prefill-1"]
        assert _environ(new)["KVRELAY_KV_SECRET"] == _environ(sibling)["KVRELAY_KV_SECRET"]
        _await_proxy_sees_healthy(c, "prefill", deadline)
        # the restarted server takes its turns again (within a few requests: the proxy's
        # view of load and health refreshes every 2 s, so allow several rounds)
        restarted = f"http://127.0.0.1:{deployment['base'] + 100}/metrics"
        for _ in range(20):
            assert c.post("/v1/completions", json=body).status_code == 200
            if _served_prompt_tokens(restarted) > 0:
                break
            time.sleep(0.3)
        routing = [line for line in c.get("/metrics").text.splitlines()
                   if line.startswith(("kvrelay_proxy:backend", "kvrelay_proxy:routing"))]
        assert _served_prompt_tokens(restarted) > 0, "\n".join(routing)


def test_sigint_stops_everything(deployment):
    proc = deployment["proc"]
    children = descendants(proc.pid)
    assert len(children) >= 4                       # 3 servers (+ engine cores) and the proxy
    ports = [deployment["base"] + o for o in OFFSETS]
    side_channels = [deployment["side"] + o for o in SIDE_OFFSETS[:2]]  # the prefill servers listen
    assert all(_listening(p) for p in ports + side_channels)
    os.killpg(proc.pid, signal.SIGINT)  # deploy's own group: what Ctrl-C in its terminal does
    assert proc.wait(60) == 0, deployment["out"].read_text()
    text = deployment["out"].read_text()
    assert "SIGINT: stopping everything" in text and "stopped 4 process(es)" in text
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in children if alive(pid)] == []
    assert [p for p in ports + side_channels if _listening(p)] == []
    logs = sorted(deployment["out"].parent.glob("*.log"))
    assert len(logs) == 4
    errors = [f"{f.name}: {line}" for f in logs for line in f.read_text().splitlines()
              if "ERROR" in line]
    assert errors == []                             # a clean shutdown is not an error


def test_no_restart_stops_everything_when_one_server_dies(tiny_no_eos, tmp_path):
    base, _ = _free_bases()
    out_path = tmp_path / "deploy.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli", "deploy", "--model", str(tiny_no_eos),
             "--port", str(base), "--base-port", str(base), "--log-dir", str(tmp_path),
             "--no-validate",
             "--no-restart", "--", "--dtype", "float32", "--max-model-len", "64",
             "--block-size", "4"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while READY not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.3)
        server = _started_pids(out_path.read_text())["serve"]
        os.killpg(server, signal.SIGKILL)
        assert proc.wait(60) == 1, out_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = out_path.read_text()
    assert "serve exited with status -9; stopping the rest" in text
    assert "restarting" not in text and "stopped 1 process(es)" in text
