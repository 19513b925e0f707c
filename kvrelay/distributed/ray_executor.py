"""Tensor-parallel ranks as Ray actors: `--distributed-executor-backend ray`.

    RayExecutor     rank 0's runner lives in the engine-core process (as with processes);
                    ranks 1..N-1 are Ray actors in one placement group (PACK: the group
                    on one node when it fits, spread over nodes when it does not)

Everything after placement is `MultiprocExecutor`'s: the ranks meet in one gloo process
group at this node's address (as the cluster knows it), every step is broadcast and the
step loop is unchanged. What differs is who owns the workers: Ray starts them, a monitor
thread waits on each actor's `run` (it only returns when told to stop, so an answer
early — an error, a dead actor or node — fails the executor, and the engine stops every
rank as for a dead process), and shutdown kills the actors and frees the placement group.

The actors never restart on their own (`max_restarts=0`): a rank cannot rejoin a process
group mid-flight, so the server fails clearly instead and whoever supervises the server
(`kvrelay deploy --backend ray`, Kubernetes) restarts it whole.

KV-transfer progress (disaggregated serving with TP > 1) comes back on a Ray queue
(`RayEvents`), as it comes on a multiprocessing queue from processes.
"""
from __future__ import annotations

import logging
import socket
from dataclasses import replace
from typing import Any

from kvrelay.distributed import ray_cluster
from kvrelay.distributed.tp_workers import (
    MultiprocExecutor,
    RankSpec,
    RunnerFactory,
    worker_main,
)

logger = logging.getLogger(__name__)


class RayEvents:
    """The ranks' KV-transfer reports over a `ray.util.queue.Queue` (picklable; the
    multiprocessing queue's interface as `disagg/worker.py` uses it)."""

    def __init__(self) -> None:
        from ray.util.queue import Queue
        self.queue = Queue(actor_options={"num_cpus": 0})

    def put(self, item: Any) -> None:
        self.queue.put(item)

    def get_nowait(self) -> Any:
        return self.queue.get_nowait()      # ray's Empty is a queue.Empty

    def cancel_join_thread(self) -> None:
        """Nothing buffered in this process to flush at exit."""

    def close(self) -> None:
        try:
            ray_cluster.require_ray().kill(self.queue.actor)
        except Exception as e:
            logger.debug("events queue: %s", e)


class RankActor:
    """One tensor-parallel rank ≥ 1 in a Ray worker process (made remote at run time:
    Ray is optional)."""

    def run(self, spec: RankSpec, rank: int, make_runner: RunnerFactory, events: Any,
            threads: int) -> int:
        import torch
        torch.set_num_threads(threads)
        worker_main(spec, rank, make_runner, events)
        return rank

    def where(self) -> tuple[str, str]:
        ray = ray_cluster.require_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


class RayExecutor(MultiprocExecutor):
    """`MultiprocExecutor` whose ranks 1..N-1 are Ray actors."""

    def __init__(self, spec: RankSpec, make_runner: RunnerFactory,
                 ray_address: str | None = None) -> None:
        self.ray = ray_cluster.connect(ray_address)
        host = ray_cluster.node_ip()
        local = spec.cpu_slices[0] if spec.cpu_slices else ()
        # rank 0 keeps this process's cores; the others run where Ray put them
        spec = replace(spec, init_method=f"tcp://{host}:{free_port_on(host)}",
                       cpu_slices=(local,) + ((),) * (spec.tp_size - 1))
        self.actors: list[Any] = []
        self.runs: list[Any] = []
        self.pg: Any = None
        self.kv_queue: Any = None
        super().__init__(spec, make_runner)

    def _start_workers(self) -> None:
        cpus = ray_cluster.cpus_per_worker()
        n = self.spec.tp_size - 1
        self.pg = ray_cluster.place([{"CPU": cpus}] * n, "PACK",
                                    f"tensor-parallel ranks 1..{n}")
        self.kv_queue = RayEvents()
        remote = self.ray.remote(RankActor)
        env = {"env_vars": ray_cluster.actor_env()}
        for i in range(n):
            actor = remote.options(num_cpus=cpus, max_restarts=0, runtime_env=env,
                                   scheduling_strategy=ray_cluster.in_bundle(self.pg, i),
                                   name=None).remote()
            self.actors.append(actor)
        # asked before `run`, which holds each actor until shutdown
        where = self.ray.get([a.where.remote() for a in self.actors])
        logger.info("tensor-parallel ranks on Ray: %s",
                    ", ".join(f"rank {r + 1} → node {node[:8]} ({ip})"
                              for r, (node, ip) in enumerate(where)))
        self.runs = [a.run.remote(self.spec, r + 1, self.make_runner, self.kv_queue, cpus)
                     for r, a in enumerate(self.actors)]

    def _monitor(self) -> None:
        pending = list(self.runs)
        while pending and not self._closing:
            done, pending = self.ray.wait(pending, num_returns=1, timeout=1.0)
            if not done or self._closing:
                continue
            rank = self.runs.index(done[0]) + 1
            try:
                self.ray.get(done[0])
                why = f"tensor-parallel rank {rank} (a Ray actor) stopped unasked"
            except Exception as e:                      # the actor, its process or its node died
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                why = f"tensor-parallel rank {rank} (a Ray actor) died: {first}"
            self._fail(why)
            return

    def _dead_worker(self) -> str | None:
        return self.failed                # the monitor names a dead actor when Ray reports it

    def _join_workers(self, timeout_s: float) -> None:
        if self.runs:
            self.ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)

    def _kill_all(self) -> None:
        ray_cluster.release(self.pg, self.actors)
        self.pg = None
        if self.kv_queue is not None:
            self.kv_queue.close()


def free_port_on(host: str) -> int:
    """A free TCP port on `host` (this node's address as the cluster knows it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
