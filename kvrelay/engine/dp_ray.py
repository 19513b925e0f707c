"""Data-parallel replicas placed by Ray: `--data-parallel-backend ray` (also implied by
`--distributed-executor-backend ray` with -dp > 1).

The head (the API server's node) runs replicas [0, local) as always (one by default under
Ray) and listens for the others exactly as it does for hand-started `--headless` nodes
(`engine/dp_link.py`: the same Hello / Welcome handshake, the same frames). What Ray
adds is who starts them and where: one actor per remote replica, all in one placement
group (SPREAD: replicas on different nodes where the cluster allows), each actor running
`run_headless` for its one rank — which starts the replica's engine core (its tensor-
parallel ranks as processes, so a TP group is packed on the actor's node) and relays for
it. The hand-run headless node stays the fallback without Ray, on the same wire and tests.

A replica whose actor, process or node dies drops its connection, or — if it never
connected — its actor's `run` ends: the head fails the replica either way, as it does a
lost headless node (the server stops; its supervisor restarts it whole).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from kvrelay.config import EngineArgs
from kvrelay.distributed import ray_cluster
from kvrelay.engine.messages import Fatal

logger = logging.getLogger(__name__)


class ReplicaActor:
    """One data-parallel replica in a Ray worker process (made remote at run time)."""

    def run(self, args: EngineArgs) -> int:
        from kvrelay.engine.dp_headless import run_headless
        logging.basicConfig(level=logging.INFO,
                            format=f"(dp rank {args.data_parallel_start_rank}) %(message)s")
        return run_headless(args, signals=False)

    def where(self) -> tuple[str, str]:
        ray = ray_cluster.require_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def replica_node_args(args: EngineArgs, rank: int) -> EngineArgs:
    """What the actor of replica `rank` runs: a headless node of that one replica, joining
    the head at its address and port, with processes for its TP ranks."""
    return replace(args, headless=True, data_parallel_start_rank=rank,
                   data_parallel_size_local=1, data_parallel_backend="mp",
                   distributed_executor_backend="mp")


class RayReplicas:
    """The actors of replicas [first, dp): placed and started in the background (the API
    server keeps starting); a replica whose actor ends while the server runs is failed."""

    def __init__(self, args: EngineArgs, remote: list[Any]) -> None:
        self.args = args
        self.remote = remote                    # RemoteReplica of each rank, in order
        self.pg: Any = None
        self.actors: list[Any] = []
        self.stopping = False
        self.ray = ray_cluster.connect(args.ray_address)

    def start(self) -> None:
        threading.Thread(target=self._run, name="kvrelay-dp-ray", daemon=True).start()

    def _run(self) -> None:
        try:
            runs = self._place()
        except Exception as e:
            self._fail_all(f"Ray could not start the data-parallel replicas: {e}")
            return
        pending = list(runs)
        while pending and not self.stopping:
            done, pending = self.ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                if self.stopping:
                    return
                replica = self.remote[runs.index(ref)]
                try:
                    code = self.ray.get(ref)
                    why = f"its Ray actor ended (exit code {code})"
                except Exception as e:                 # the actor, process or node died
                    why = f"its Ray actor died: {(str(e).strip().splitlines() or ['?'])[0]}"
                replica.receive(Fatal(f"data-parallel replica {replica.rank}: {why}"))

    def _place(self) -> list[Any]:
        per_replica = self.args.tensor_parallel_size * ray_cluster.cpus_per_worker()
        ranks = [r.rank for r in self.remote]
        self.pg = ray_cluster.place([{"CPU": per_replica}] * len(ranks), "SPREAD",
                                    f"data-parallel replicas {ranks[0]}..{ranks[-1]}")
        remote = self.ray.remote(ReplicaActor)
        env = {"env_vars": ray_cluster.actor_env()}
        for i in range(len(ranks)):
            self.actors.append(remote.options(
                num_cpus=per_replica, max_restarts=0, runtime_env=env,
                scheduling_strategy=ray_cluster.in_bundle(self.pg, i)).remote())
        # asked before `run`, which holds each actor until shutdown
        where = self.ray.get([a.where.remote() for a in self.actors])
        logger.info("data-parallel replicas on Ray: %s",
                    ", ".join(f"rank {r} → node {node[:8]} ({ip})"
                              for r, (node, ip) in zip(ranks, where, strict=True)))
        return [a.run.remote(replica_node_args(self.args, r))
                for r, a in zip(ranks, self.actors, strict=True)]

    def _fail_all(self, why: str) -> None:
        logger.error("%s", why)
        for replica in self.remote:
            replica.receive(Fatal(f"data-parallel replica {replica.rank}: {why}"))

    def shutdown(self) -> None:
        """After the head told the replicas to stop (and waited for their nodes)."""
        self.stopping = True
        ray_cluster.release(self.pg, self.actors)
        self.pg, self.actors = None, []
