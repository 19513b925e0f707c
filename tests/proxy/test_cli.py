"""`kvrelay.proxy.main.main(argv)`: flag errors, --help, signals, a taken port."""
from __future__ import annotations

import signal

import pytest

from kvrelay.proxy.main import main
from tests.processes import free_port
from tests.proxy.fakes import ProxyProcess, client, refused_port


@pytest.mark.parametrize("argv, message", [
    (["--prefiller-host", "a", "b", "--prefiller-port", "1", "2", "3"],
     ("kvrelay proxy: error: --prefiller-host has 2 values and --prefiller-port has 3: give one "
      "host, one port, or as many hosts as ports")),
    (["--decoder-port", "x"],
     "kvrelay proxy: error: argument --decoder-port/--decoder-ports: invalid int value: 'x'"),
    (["--bogus"], "kvrelay proxy: error: unrecognized arguments: --bogus"),
])
def test_flag_errors_are_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    assert capsys.readouterr().err == message + "\n"


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--prefiller-port" in capsys.readouterr().out


def test_signals_exit_0_and_taken_port_exits_1(tmp_path):
    port_a, port_b = free_port(), free_port()
    (s1, dead_p), (s2, dead_d) = refused_port(), refused_port()
    backends = ["--prefiller-port", str(dead_p), "--decoder-port", str(dead_d)]
    procs = [ProxyProcess(["--port", str(p), *backends], tmp_path / f"{p}.log")
             for p in (port_a, port_b)]
    try:
        for p in procs:
            p.wait_ready()
        log = procs[0].log()
        assert f"prefill servers (cache_aware): http://127.0.0.1:{dead_p}" in log
        assert f"decode servers (cache_aware): http://127.0.0.1:{dead_d}" in log
        with client() as c:                                   # backends absent: /health says so
            r = c.get(f"{procs[0].url}/health")
        assert r.status_code == 503 and len(r.json()["down"]) == 2
        taken = ProxyProcess(["--port", str(port_a)], tmp_path / "taken.log")
        try:
            assert taken.proc.wait(30) == 1
            # one line, and nothing started: no app, no lifespan, no backend list
            assert taken.log().strip() == ("kvrelay proxy: error: cannot listen on "
                                           f"127.0.0.1:{port_a}: address already in use")
        finally:
            taken.stop()
    finally:
        codes = [procs[0].stop(signal.SIGINT), procs[1].stop(signal.SIGTERM)]
        s1.close()
        s2.close()
    assert codes == [0, 0]
