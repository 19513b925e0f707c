"""A real local Ray cluster for the tests of the Ray backends: three nodes on 127.0.0.1 (a
head with no CPUs for actors, two nodes of 3 CPUs), one per test run, and a look at the
Ray actor processes on this machine. Skips its importer when Ray is not installed."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Ray finds each node's address from the route out of the machine; this pins every node,
# driver and actor of the test cluster to loopback (servers in tests listen on 127.0.0.1).
# Ray reads it when imported, so it is set before the import (it concerns only Ray).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="Ray is the optional extra kvrelay[ray]")

NODE_CPUS = 3


@dataclass
class RayCluster:
    address: str
    head_id: str
    cluster: Any                       # ray.cluster_utils.Cluster: add_node / remove_node

    def __iter__(self):
        return iter((self.address, self.head_id))


@pytest.fixture(scope="session")
def ray_cluster():
    """A running three-node cluster (unpacks as (address, head node id)), one for the whole
    run (starting one costs seconds; each test leaves no actor behind, and a test that
    removes a node adds one first, so every test finds a head and two nodes of NODE_CPUS)."""
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        c.add_node(num_cpus=NODE_CPUS)
        c.add_node(num_cpus=NODE_CPUS)
        c.wait_for_nodes()
        yield RayCluster(c.address, c.head_node.node_id, c)
    finally:
        c.shutdown()


def ray_actor_pids(kind: str) -> list[int]:
    """Processes of Ray actors of `kind` (Ray names them `ray::Kind...`) on this machine."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(f"ray::{kind}".encode()):
            out.append(int(pid))
    return out


def wait_actors_gone(kind: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while ray_actor_pids(kind) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_actor_pids(kind), f"{kind} actors left behind"
