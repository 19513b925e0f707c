"""vLLM's multi-node data-parallel flags on 127.0.0.1: a head (API server + replica 0)
and a --headless node (replica 1) that joins it over --data-parallel-rpc-port; and
layouts refused at startup with the numbers named."""
from __future__ import annotations

import json
import time

import pytest

from kvrelay.cli import main
from tests.distributed.test_expert_parallel_dp import (
    BASE,
    check_layout,
    check_tokens,
    run_workload,
    tp1_tokens,  # noqa: F401
)
from tests.processes import KvrelayProcess, Server, alive, descendants, free_port


def headless(model: str, rpc_port: int, extra: list[str], log,
             env: dict[str, str] | None = None) -> KvrelayProcess:
    return KvrelayProcess(["serve", model, *BASE, "-dp", "2", "--data-parallel-size-local", "1",
                           "--data-parallel-start-rank", "1", "--headless",
                           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
                           str(rpc_port), *extra], log, env)


def test_head_and_headless_node_match_tp1(tiny, tp1_tokens, tmp_path):  # noqa: F811
    rpc = free_port()
    head = Server(str(tiny[0]), BASE + ["-dp", "2", "--data-parallel-size-local", "1",
                                        "--enable-expert-parallel",
                                        "--data-parallel-rpc-port", str(rpc)],
                  tmp_path / "head.log")
    node = headless(str(tiny[0]), rpc, ["--enable-expert-parallel"], tmp_path / "headless.log")
    try:
        head.wait_ready()
        assert "joined with data-parallel ranks [1]" in head.log()
        check_layout(head.log(), 2)                 # rank 1's experts live in the headless node
        check_tokens(tiny, run_workload(head.url), tp1_tokens)
        assert head.metrics()["kvrelay:dp_dummy_steps_total"] > 0
        family = descendants(head.proc.pid) + descendants(node.proc.pid)
        head.proc.terminate()  # SIGTERM to the server only: drain, stop all replicas
        assert head.proc.wait(60) == 0
        assert node.proc.wait(30) == 0
        deadline = time.monotonic() + 20
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in family if alive(p)], "orphan processes left behind"
    finally:
        head.stop()
        node.stop()


def test_headless_node_with_other_sizes_is_refused(tiny, tmp_path):
    rpc = free_port()
    head = Server(str(tiny[0]), BASE + ["-dp", "2", "--data-parallel-size-local", "1",
                                        "--data-parallel-rpc-port", str(rpc)],
                  tmp_path / "head.log")
    node = KvrelayProcess(["serve", str(tiny[0]), *BASE, "-dp", "3", "--data-parallel-size-local",
                           "1", "--data-parallel-start-rank", "1", "--headless",
                           "--data-parallel-rpc-port", str(rpc)],
                          tmp_path / "headless.log")
    try:
        assert node.proc.wait(120) == 1
        lines = [ln for ln in node.log().splitlines() if "error" in ln]
        want = ("kvrelay serve: error: the data-parallel head refused this node: "
                "--data-parallel-size differs: the head has 2, the headless node 3")
        assert lines == [want], node.log()[-2000:]
        head.wait_for_line("refused a headless node", 30)
    finally:
        head.stop()
        node.stop()


def test_unreachable_head_is_a_clear_error(tiny, tmp_path):
    port = free_port()
    node = headless(str(tiny[0]), port, [], tmp_path / "headless.log",
                    env={"KVRELAY_ENGINE_READY_TIMEOUT_S": "2"})
    try:
        assert node.proc.wait(60) == 1
        assert f"cannot reach the data-parallel head at 127.0.0.1:{port}" in node.log()
        assert "Traceback" not in node.log()
    finally:
        node.stop()


@pytest.mark.parametrize("flags,message", [
    (["-dp", "3", "--enable-expert-parallel"],
     "expert-parallel width 3 (TP 1 × DP 3) does not divide the 4 experts"),
    (["-tp", "2", "-dp", "3", "--enable-expert-parallel"],
     "expert-parallel width 6 (TP 2 × DP 3) does not divide the 4 experts"),
    (["-dp", "2", "--enable-expert-parallel", "--additional-config",
      json.dumps({"neuron_config": {"ep_degree": 2, "embedding_dp_size": 2}}), "-tp", "2"],
     ("neuron_config.ep_degree 2 conflicts with --enable-expert-parallel across 2 data-parallel "
      "replicas (EP = TP 2 × DP 2 = 4)")),
    (["-dp", "2", "--additional-config", json.dumps({"neuron_config": {"lm_head_dp_size": 4}})],
     "neuron_config.lm_head_dp_size 4 must equal --data-parallel-size 2"),
    (["-dp", "2", "--data-parallel-size-local", "3"],
     "--data-parallel-size-local 3 must be between 1 and --data-parallel-size 2"),
    (["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank", "2",
      "--headless"],
     "--data-parallel-start-rank 2 + --data-parallel-size-local 1 exceeds --data-parallel-size 2"),
    (["-dp", "2", "--headless"], "--headless needs --data-parallel-start-rank ≥ 1"),
])
def test_invalid_layouts_are_refused_at_startup(tiny, capsys, flags, message):
    assert main(["serve", str(tiny[0]), "--port", str(free_port()), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
