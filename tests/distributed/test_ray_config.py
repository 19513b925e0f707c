"""The Ray backends' settings without a cluster: flag checks, what a replica's actor runs,
what an actor inherits, and an address nobody answers at."""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from kvrelay.config import EngineArgs
from kvrelay.distributed import ray_cluster
from kvrelay.engine.dp_ray import replica_node_args


def test_ray_places_replicas_beyond_the_head_by_default():
    assert EngineArgs(data_parallel_size=4).local_replicas == 4
    assert EngineArgs(data_parallel_size=4, data_parallel_backend="ray").local_replicas == 1
    assert EngineArgs(data_parallel_size=4, distributed_executor_backend="ray").local_replicas == 1
    explicit = EngineArgs(data_parallel_size=4, data_parallel_backend="ray",
                          data_parallel_size_local=2)
    assert explicit.local_replicas == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"distributed_executor_backend": "slurm"},
     "--distributed-executor-backend must be one of mp, uni, ray, got 'slurm'"),
    ({"data_parallel_backend": "ray2"}, "--data-parallel-backend must be mp or ray, got 'ray2'"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
     "--distributed-executor-backend uni runs one rank; use mp or ray for "
     "--tensor-parallel-size 2"),
    ({"data_parallel_backend": "ray", "data_parallel_size": 2, "headless": True,
      "data_parallel_start_rank": 1, "data_parallel_size_local": 1},
     "--headless is the hand-run alternative to Ray placing the replicas"),
])
def test_bad_backend_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(**kwargs)


def test_a_replica_actor_runs_one_headless_replica_with_processes_for_its_ranks():
    head = EngineArgs(data_parallel_size=3, tensor_parallel_size=2, data_parallel_backend="ray",
                      distributed_executor_backend="ray", data_parallel_address="10.0.0.5",
                      data_parallel_rpc_port=41000)
    node = replica_node_args(head, 2)
    assert (node.headless, node.data_parallel_start_rank, node.local_replicas) == (True, 2, 1)
    assert (node.data_parallel_backend, node.distributed_executor_backend) == ("mp", "mp")
    assert (node.data_parallel_address, node.data_parallel_rpc_port) == ("10.0.0.5", 41000)
    assert node.tensor_parallel_size == 2


def test_actors_inherit_kvrelay_settings_and_the_secret_but_not_rays_address():
    env = {"KVRELAY_KV_SECRET": "s3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
           "RAY_ADDRESS": "x:1", "HOME": "/root", "PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE",
           "GLOO_SOCKET_IFNAME": "lo"}
    assert ray_cluster.actor_env(env) == {
        "KVRELAY_KV_SECRET": "s3", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "OMP_WAIT_POLICY": "PASSIVE", "GLOO_SOCKET_IFNAME": "lo"}


def test_an_address_nobody_answers_at_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                # closed again: nobody listens there
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
        ray_cluster._check_reachable(f"127.0.0.1:{port}")
    ray_cluster._check_reachable("auto")            # Ray's own lookup: not probed here
    ray_cluster._check_reachable("ray://head:10001")


def test_deployed_servers_claim_the_least_claimed_cores_of_their_host(tmp_path):
    """A Ray-placed server is pinned like a locally deployed one: its share of the host's
    cores, the least claimed first; claims of processes that are gone do not count."""
    from kvrelay.deploy.ray_actors import claim_cores
    mine = sorted(os.sched_getaffinity(0))
    table = tmp_path / "cores.json"
    gone = subprocess.Popen(["true"])
    gone.wait()                                            # a pid nobody has any more
    table.write_text(json.dumps({"1": [mine[0]], str(gone.pid): mine[1:]}))
    want = [mine[1]] if len(mine) > 1 else mine
    assert claim_cores(1, table) == want                   # mine[0] is init's; the rest free
    claims = json.loads(table.read_text())
    assert claims == {"1": [mine[0]], str(os.getpid()): want}
    assert claim_cores(len(mine) + 3, table) == mine       # never more than the host has
    table.write_text("not json")
    assert claim_cores(1, table) == mine[:1]               # a torn table starts over
