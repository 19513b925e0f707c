"""`kvrelay deploy --backend ray` end to end on a real three-node Ray cluster (127.0.0.1): 2P1D
of the tiny checkpoint placed as detached actors; the openai client through the proxy gets the
single-instance tokens and `kvrelay validate --expect-di` passes; `deploy status` lists every
server; a killed prefill server is restarted by Ray and taken back by the proxy, and a lost
node's servers come back on another (the requests in flight fail fast and cleanly, none hangs
or gets an empty 200); scaling prefill 2 → 3 → 1 under load fails no request; `--down` leaves
no actor, process or held KV block behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.deploy.test_deploy_e2e import _free, _free_bases, _listening
from tests.distributed.test_expert_parallel_dp import (
    BASE,
    check_tokens,
    run_workload,
    tp1_tokens,  # noqa: F401
)
from tests.ray_cluster import NODE_CPUS, ray_cluster, wait_actors_gone  # noqa: F401

NAME = "t-ray"
LEASE_S = 20


def deploy(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", "deploy", *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"PYTHONUNBUFFERED": "1"})


def serve_pids(port: int) -> list[int]:
    """`kvrelay serve` processes listening (by their command line) on `port`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvrelay.cli" in cmd and b"serve" in cmd and str(port).encode() in cmd:
            out.append(int(pid))
    return out


def active(metrics: str, role: str) -> float:
    name = f'kvrelay_proxy:backends{{role="{role}",state="active"}}'
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines() if ln.startswith(name))


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def scrape(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(name) and not ln.startswith("#"))


def metric(url: str, name: str) -> float:
    return scrape(httpx.get(f"{url}/metrics", timeout=10).text, name)


class Load:
    """Short completions through the proxy, one after another, until stopped; each outcome
    recorded with the phase it happened in."""

    def __init__(self, url: str) -> None:
        self.url, self.phase = url, "warm"
        self.results: list[tuple[str, int, float, str]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stopped.is_set():
                t0 = time.monotonic()
                try:
                    r = c.post(f"{self.url}/v1/completions", json={
                        "prompt": [5, 17, 29, 40, 41, 42], "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True})
                    code, body = r.status_code, r.text
                except httpx.HTTPError as e:
                    code, body = 0, repr(e)
                self.results.append((self.phase, code, time.monotonic() - t0, body))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(90)

    def failures(self, phase: str) -> list[tuple[str, int, float, str]]:
        return [r for r in self.results if r[0] == phase and r[1] != 200]


def test_ray_deploy_2p1d_restart_scale_and_down(tiny, tiny_no_eos, tp1_tokens, ray_cluster,  # noqa: F811
                                                tmp_path):
    address, _ = ray_cluster
    base, side = _free_bases()
    assert _free(base + 102)                         # prefill-2's port, once scaled to 3
    common = ["--name", NAME, "--ray-address", address]
    load = None
    try:
        t0 = time.monotonic()
        # a short lease: a request whose proxy dies with a lost node after its prefill leg
        # frees its held blocks within the test (the topology's env reaches every server)
        config = tmp_path / "topology.yaml"
        config.write_text(f"env:\n  VLLM_NIXL_ABORT_REQUEST_TIMEOUT: '{LEASE_S}'\n")
        up = deploy("--backend", "ray", *common, "--config", str(config),
                    "--model", str(tiny_no_eos), "--prefill", "2",
                    "--decode", "1", "--port", str(base), "--base-port", str(base),
                    "--side-channel-port", str(side),
                    "--log-dir", str(tmp_path / "logs"), "--", *BASE)
        ready_s = time.monotonic() - t0
        assert up.returncode == 0, up.stdout + up.stderr
        url = re.search(r"OpenAI base URL: (http://[\d.:]+)/v1", up.stdout)[1]  # type: ignore[index]
        assert url == f"http://127.0.0.1:{base}"
        nodes = set(re.findall(r"(prefill-\d|decode-0)\s+\S+\s+node (\w+)", up.stdout))
        assert len(nodes) == 3 and len({n for _, n in nodes}) == 2, up.stdout   # SPREAD

        check_tokens(tiny, run_workload(url), tp1_tokens)
        validate = subprocess.run([sys.executable, "-m", "kvrelay.cli", "validate", "--base-url",
                                   url, "--expect-di", "--num-requests", "4"],
                                  capture_output=True, text=True, timeout=300)
        assert validate.returncode == 0, validate.stdout + validate.stderr

        status = deploy("status", *common)
        rows = [ln for ln in status.stdout.splitlines()[1:] if ln.strip()]
        assert status.returncode == 0 and len(rows) == 4, status.stdout + status.stderr
        assert all(" ready " in ln for ln in rows), status.stdout

        # a killed server: Ray restarts its actor and the server; the proxy takes it back
        load = Load(url)
        time.sleep(1)
        load.phase = "restart"
        [victim] = serve_pids(base + 100)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while not (serve_pids(base + 100) and health(f"http://127.0.0.1:{base + 100}") == 200):
            assert time.monotonic() - killed < 120, "prefill-0 never came back"
            time.sleep(0.2)
        back_s = time.monotonic() - killed
        while metric(url, 'kvrelay_proxy:backends{role="prefill",state="active"}') < 2:
            assert time.monotonic() - killed < 120
            time.sleep(0.2)
        taken_back_s = time.monotonic() - killed
        for _phase, code, seconds, body in load.failures("restart"):
            assert code in (502, 503, 504) and seconds < 30 and '"error"' in body, (code, body)
        assert all(r[3] and '"choices"' in r[3] for r in load.results if r[1] == 200)

        # a whole node lost (a fresh one joined first): Ray restarts its servers elsewhere
        cluster = ray_cluster.cluster
        fresh = cluster.add_node(num_cpus=NODE_CPUS)
        cluster.wait_for_nodes()
        status = deploy("status", *common)
        where = dict(re.findall(r"^(prefill-1)\s+(\w+)", status.stdout, re.M))
        [lost] = [n for n in cluster.worker_nodes
                  if n.node_id.startswith(where["prefill-1"]) and n is not fresh]
        load.phase = "node"
        lost_at = time.monotonic()
        cluster.remove_node(lost, allow_graceful=False)
        while True:        # every actor ready again, none on the lost node, the proxy has them
            status = deploy("status", *common)
            try:
                text = httpx.get(f"{url}/metrics", timeout=10).text
            except httpx.HTTPError:
                text = ""
            if (status.returncode == 0 and where["prefill-1"] not in status.stdout
                    and active(text, "prefill") >= 2 and active(text, "decode") >= 1):
                break
            assert time.monotonic() - lost_at < 180, "the lost node's servers never came back"
            time.sleep(0.5)
        node_back_s = time.monotonic() - lost_at
        # the proxy itself may have been on the lost node: its clients then see the
        # connection drop or be refused until Ray restarts it — never a hang or an empty 200
        for _phase, code, seconds, body in load.failures("node"):
            assert seconds < 30, (code, body)
            dropped = ("ConnectError", "ReadError", "RemoteProtocolError", "WriteError")
            assert (code in (502, 503, 504) and '"error"' in body) or (
                code == 0 and body.startswith(dropped)), body
        load.phase = "after the node"
        while sum(1 for r in load.results if r[0] == "after the node") < 3:
            time.sleep(0.2)
        assert not load.failures("after the node"), load.failures("after the node")[:3]

        load.phase = "scale"
        up3 = deploy("scale", *common, "--prefill", "3", timeout=300)
        assert up3.returncode == 0, up3.stdout + up3.stderr
        while metric(url, 'kvrelay_proxy:backends{role="prefill",state="active"}') < 3:
            time.sleep(0.2)
        down1 = deploy("scale", *common, "--prefill", "1", timeout=300)
        assert down1.returncode == 0, down1.stdout + down1.stderr
        assert "drained and stopped prefill-2" in down1.stdout
        assert "drained and stopped prefill-1" in down1.stdout
        time.sleep(2)
        load.stop()
        assert not load.failures("scale"), load.failures("scale")[:3]
        scaled = [r for r in load.results if r[0] == "scale"]
        assert len(scaled) >= 5
        assert not serve_pids(base + 101) and not serve_pids(base + 102)

        # no block held anywhere: the decode holds none; a prefill may still hold a request's
        # blocks for a decode read that will never come (its proxy was lost with the node
        # after the prefill leg) — only until the lease, never past it
        assert metric(f"http://127.0.0.1:{base + 200}", "kvrelay:kv_blocks_used") == 0
        prefill0, held_until = f"http://127.0.0.1:{base + 100}", time.monotonic() + LEASE_S + 5
        while metric(prefill0, "kvrelay:kv_blocks_used"):
            text = httpx.get(f"{prefill0}/metrics", timeout=10).text
            assert (scrape(text, "kvrelay:kv_blocks_used")    # (held ones may share a block)
                    <= scrape(text, "kvrelay:kv_blocks_held_for_remote")), text
            assert time.monotonic() < held_until, text
            time.sleep(0.5)
        print(f"ray deploy: ready {ready_s:.1f}s, prefill back {back_s:.1f}s, taken back by the "
              f"proxy {taken_back_s:.1f}s, a lost node's servers back {node_back_s:.1f}s, "
              f"{len(scaled)} requests while scaling")
    finally:
        if load is not None:
            load.stop()
        down = deploy("--down", *common, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
    wait_actors_gone("ServerActor")
    wait_actors_gone("ProxyActor")
    for port in (base, base + 100, base + 101, base + 102, base + 200):
        assert not _listening(port), port
