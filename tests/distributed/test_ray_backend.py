"""`--distributed-executor-backend ray` / `--data-parallel-backend ray` on a real local Ray
cluster of three nodes (a head with no CPUs for actors, two nodes of 3 CPUs), all on
127.0.0.1: tensor-parallel ranks and data-parallel replicas placed on other nodes give
the single-instance tokens; the actors go away with the server; no cluster, or no room
in it, is a one-line error."""
from __future__ import annotations

import os
import re
import signal
import threading

import httpx

from tests.distributed.test_expert_parallel_dp import (
    BASE,
    check_layout,
    check_tokens,
    run_workload,
    tp1_tokens,  # noqa: F401
)
from tests.distributed.test_worker_death import _await_running as await_running
from tests.processes import KvrelayProcess, Server, free_port
from tests.ray_cluster import ray_actor_pids, ray_cluster, wait_actors_gone  # noqa: F401

PLACED = re.compile(r"on Ray: rank (\d+) → node (\w+) \(([\d.]+)\)")


def placed_off_head(log: str, head_id: str) -> list[int]:
    """The ranks the log says Ray placed, each checked to be on a node other than the head."""
    rows = PLACED.findall(log)
    assert rows, log[-3000:]
    for _rank, node, ip in rows:
        assert not head_id.startswith(node) and ip == "127.0.0.1", rows
    return [int(r) for r, _, _ in rows]


def test_tp2_with_rank1_on_another_node_matches_tp1(tiny, tp1_tokens, ray_cluster, tmp_path):  # noqa: F811
    address, head_id = ray_cluster
    s = Server(str(tiny[0]), BASE + ["-tp", "2", "--distributed-executor-backend", "ray",
                                     "--ray-address", address], tmp_path / "serve.log")
    try:
        s.wait_ready()
        assert placed_off_head(s.log(), head_id) == [1]
        assert ray_actor_pids("RankActor")
        check_tokens(tiny, run_workload(s.url), tp1_tokens)
        assert s.metrics()["kvrelay:kv_blocks_used"] == 0
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        wait_actors_gone("RankActor")
    finally:
        s.stop()


def test_dp2_experts_across_replicas_placed_by_ray_match_tp1(tiny, tp1_tokens, ray_cluster,  # noqa: F811
                                                              tmp_path):
    address, head_id = ray_cluster
    s = Server(str(tiny[0]), BASE + ["-dp", "2", "--enable-expert-parallel",
                                     "--data-parallel-backend", "ray", "--ray-address", address],
               tmp_path / "serve.log")
    try:
        s.wait_ready()
        assert placed_off_head(s.log(), head_id) == [1]      # replica 0 stays with the API server
        check_layout(s.log(), 2)                  # replica 1's experts live in its Ray actor
        check_tokens(tiny, run_workload(s.url), tp1_tokens)
        m = s.metrics()
        assert m["kvrelay:dp_dummy_steps_total"] > 0 and m["kvrelay:kv_blocks_used"] == 0
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        wait_actors_gone("ReplicaActor")
    finally:
        s.stop()


def test_killed_rank_actor_fails_the_server_cleanly(tiny, ray_cluster, tmp_path):  # noqa: F811
    """As for a dead worker process (test_worker_death.py): the request in flight gets a
    503 naming the rank, the server exits 1, the actors are gone."""
    address, _ = ray_cluster
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "4096", "--block-size",
                              "4", "-tp", "2", "--distributed-executor-backend", "ray",
                              "--ray-address", address], tmp_path / "serve.log")
    try:
        s.wait_ready()
        [pid] = ray_actor_pids("RankActor")
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        await_running(s.url)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert result["r"].status_code == 503
        assert "tensor-parallel rank 1 (a Ray actor) died" in result["r"].json()["error"]["message"]
        assert s.proc.wait(60) == 1
        wait_actors_gone("RankActor")
    finally:
        s.stop()


def test_no_cluster_and_no_room_are_one_line_errors(tiny, ray_cluster, tmp_path):  # noqa: F811
    address, _ = ray_cluster
    nowhere = KvrelayProcess(["serve", str(tiny[0]), *BASE, "-tp", "2",
                              "--distributed-executor-backend", "ray", "--ray-address",
                              f"127.0.0.1:{free_port()}"], tmp_path / "nowhere.log",
                             )
    # 4 CPUs per rank: the nodes have 3
    full = KvrelayProcess(["serve", str(tiny[0]), *BASE, "-tp", "2",
                           "--distributed-executor-backend", "ray", "--ray-address", address],
                          tmp_path / "full.log",
                          env={"KVRELAY_RAY_CPUS_PER_WORKER": "4",
                               "KVRELAY_RAY_PLACEMENT_TIMEOUT_S": "2"})
    try:
        assert nowhere.proc.wait(120) == 1
        errors = [ln for ln in nowhere.log().splitlines() if "error" in ln]
        assert len(errors) == 1 and "cannot join a Ray cluster at '127.0.0.1:" in errors[0], \
            nowhere.log()[-2000:]
        assert "ray start --head" in errors[0]
        assert full.proc.wait(120) == 1
        assert "Ray could not place tensor-parallel ranks 1..1: 1 bundle(s) of {'CPU': 4}" \
            in full.log(), full.log()[-3000:]
        wait_actors_gone("RankActor")
    finally:
        nowhere.stop()
        full.stop()
