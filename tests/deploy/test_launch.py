"""What deploy does before and when things go wrong: taken ports and other hosts refused
before anything starts; a server that fails at startup stops the rest, with its log tail."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvrelay.deploy.launcher import child_env
from kvrelay.deploy.main import main
from tests.factories import TINY
from tests.processes import alive


@pytest.fixture()
def config_dir(tmp_path):
    """A checkpoint directory with only config.json: enough to plan, and for serve to parse
    its flags."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "gpt_oss"} | TINY))
    return tmp_path / "ckpt"


def test_a_taken_port_is_refused_before_anything_starts(config_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["--model", str(config_dir), "--prefill", "1", "--decode", "1", "--base-port",
                   str(port - 100), "--side-channel-port", str(port + 1000), "--port",
                   str(_free_block())])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"prefill-0 HTTP port {port} is already in use on this machine" in err


def test_other_hosts_need_dry_run(config_dir, capsys):
    rc = main(["--model", str(config_dir), "--prefill", "1", "--decode", "1", "--hosts",
               "decode=10.0.0.2"])
    assert rc == 1
    assert "use --dry-run and run the printed commands on each host" in capsys.readouterr().err


def test_the_plan_overrides_kvrelay_twins_of_its_variables(monkeypatch):
    monkeypatch.setenv("KVRELAY_VISIBLE_DEVICES", "5")
    monkeypatch.setenv("KVRELAY_NIXL_SIDE_CHANNEL_PORT", "1")
    env = child_env((("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),),
                    (("NEURON_VISIBLE_DEVICES", "0-3"), ("VLLM_NIXL_SIDE_CHANNEL_PORT", "5559")))
    assert "KVRELAY_VISIBLE_DEVICES" not in env and "KVRELAY_NIXL_SIDE_CHANNEL_PORT" not in env
    assert env["NEURON_VISIBLE_DEVICES"] == "0-3" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5559"


def test_a_server_that_fails_stops_the_rest_and_shows_its_log(config_dir, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "deploy", "--model", str(config_dir), "--prefill",
         "1", "--decode", "1",
         "--port", str(base := _free_block()), "--base-port", str(base),
         "--side-channel-port", str(_free_block()),
         "--log-dir", str(tmp_path / "logs"), "--", "--no-such-flag"],
        capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "exited with status 2 before it was ready; last lines of" in out
    assert "unrecognized arguments: --no-such-flag" in out  # the server's own message, in the tail
    assert "stopped 2 process(es)" in out
    started = next(line for line in out.splitlines() if line.startswith("kvrelay deploy: started "))
    pids = [int(p.split(")")[0]) for p in started.split("(pid ")[1:]]
    assert len(pids) == 2 and [p for p in pids if alive(p)] == []


def _free_block() -> int:
    """A port P with P, P+1, P+100, P+200 free."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 200 < 65536 and all(_free(base + o) for o in (0, 1, 100, 200)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True



@pytest.mark.parametrize("where", ["http", "side_channel"])
def test_serve_refuses_a_taken_port_in_one_line_before_the_model_loads(tiny, where):
    """The port is checked before anything slow: nothing else is printed (no engine, no model
    loading)."""
    kv = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = _free_block()
        http, side = (port, free) if where == "http" else (free, port)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", str(tiny[0]), "--port",
                            str(http),
                            "--kv-transfer-config", kv], capture_output=True, text=True, timeout=60,
                           check=False, env=os.environ | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)})
        elapsed = time.monotonic() - t0
    what = "HTTP" if where == "http" else \
        "KV side channel (VLLM_NIXL_SIDE_CHANNEL_PORT (or KVRELAY_NIXL_SIDE_CHANNEL_PORT))"
    assert r.returncode == 1, f"{r.stdout}{r.stderr} ({elapsed:.1f}s)"
    assert r.stdout == "" and r.stderr == (
        f"kvrelay serve: error: cannot listen on 127.0.0.1:{port} ({what}): address already in "
        "use; stop what uses it or choose another port\n"), f"after {elapsed:.1f}s"


def test_supervise_restarts_with_growing_backoff(config_dir, tmp_path):
    """A process that keeps dying is restarted after 1 s, then 2 s, … (each restart said)."""
    from kvrelay.deploy.launcher import Component, Deployment
    from kvrelay.deploy.main import build_parser, build_plan
    plan = build_plan(build_parser().parse_args(["--model", str(config_dir)]), [])
    deployment = Deployment(plan, tmp_path)
    flaky = Component("flaky", ("serve", "--no-such-flag"), child_env((), ()),
                      tmp_path / "flaky.log")
    deployment.components.append(flaky)
    flaky.start()
    said: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=deployment.supervise, args=(stop, said.append))
    watcher.start()
    try:
        deadline = time.monotonic() + 60
        while sum("restarting it in" in s for s in said) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        watcher.join(10)
        deployment.stop(grace=5)
    waits = [s.split("restarting it in ")[1].split(" (")[0] for s in said
             if "restarting it in" in s]
    assert waits[:3] == ["1s", "2s", "4s"], said
    assert said[0].startswith("flaky (pid ") and "exited with status 2" in said[0]
    assert "unrecognized arguments: --no-such-flag" in said[0]          # its log tail
    assert sum(s.startswith("restarted flaky (pid ") for s in said) >= 2
    assert flaky.log_text().count("unrecognized arguments") >= 3  # restarts append to the log
