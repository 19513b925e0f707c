"""Data parallelism: N engine replicas behind one API server.

Owner of: the replicas and the placement of requests. A replica is an `AsyncEngine`
(its own engine-core process, scheduler, KV cache and tensor-parallel ranks) on this
node, or a `RemoteReplica` run by a headless node (`kvrelay/engine/dp_remote.py`)
that connected to this head over --data-parallel-rpc-port. A request goes to the
replica with the fewest requests in flight (ties: fewest waiting in its scheduler),
and stays there. It is an `EngineClient`, as `AsyncEngine` is, so the server does not know.

    node 0 (head): API server + replicas [0, local)      listens on address:rpc_port
    node k (--headless): replicas [start, start + local)  connects to the head
    Ray actor (--data-parallel-backend ray): one replica  placed by Ray, connects the same
                                                          way (`engine/dp_ray.py`)

Expert parallelism across replicas (`--enable-expert-parallel` with DP > 1): the
experts are sharded over all TP × DP ranks, which meet in one expert world at
--data-parallel-address (port chosen here, sent to headless nodes). The replicas step
in lockstep (`engine/lockstep.py`); this class wakes all of them after every add.

Replica r's device slice is the r-th equal share (among this node's replicas) of the
visible devices (`engine/dp_placement.py`).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncGenerator
from dataclasses import replace

from kvrelay.config import EngineArgs
from kvrelay.engine.async_client import AsyncEngine
from kvrelay.engine.core_client import CoreClient
from kvrelay.engine.dp_placement import replica_args
from kvrelay.engine.dp_ray import RayReplicas
from kvrelay.engine.dp_remote import HeadListener, RemoteReplica
from kvrelay.engine.messages import EngineInfo, EngineStats, Wake
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _ray_head_args(args: EngineArgs) -> EngineArgs:
    """With Ray placing replicas, nobody types the head's address and port: the address
    is this node's as the cluster knows it, the port a free one there."""
    from kvrelay.distributed import ray_cluster
    ray_cluster.connect(args.ray_address)
    host = ray_cluster.node_ip()
    return replace(args, data_parallel_address=host, data_parallel_rpc_port=free_port(host))


class DataParallelEngine:
    """An `EngineClient` (`engine/client.py`) over N replicas."""

    def __init__(self, args: EngineArgs, step_timeout_s: float | None = None) -> None:
        self.args = args
        self.ray: RayReplicas | None = None
        if args.ray_replicas and args.local_replicas < args.data_parallel_size:
            args = self.args = _ray_head_args(args)
        self.lockstep = args.experts_across_replicas
        if self.lockstep and args.data_parallel_master_port is None:
            args = replace(args, data_parallel_master_port=free_port(args.data_parallel_address))
            self.args = args
        local = args.local_replicas
        self.replicas: list[CoreClient] = [AsyncEngine(replica_args(args, r), step_timeout_s)
                                           for r in range(local)]
        self.listener: HeadListener | None = None
        if local < args.data_parallel_size:
            remote = [RemoteReplica(r, step_timeout_s)
                      for r in range(local, args.data_parallel_size)]
            self.replicas += remote
            self.listener = HeadListener(args, remote)
            if args.ray_replicas:
                self.ray = RayReplicas(args, remote)
        for r in self.replicas:
            r.group = self if self.lockstep else None
        self.ready = asyncio.Event()
        self.placement: dict[str, CoreClient] = {}
        self.wave = 0

    def wake_all(self) -> None:
        """Lockstep: tell every replica a request was added somewhere (wave number w)."""
        self.wave += 1
        for r in self.replicas:
            try:
                r._send(Wake(self.wave))
            except (OSError, RuntimeError) as e:  # a dead replica; the watchdog stops the server
                logger.debug("wake not delivered to a replica: %s", e)

    # -- the EngineClient interface --------------------------------------------------------
    @property
    def dead(self) -> str | None:
        """Why a replica failed; the one that names an exited process first (with experts
        across replicas the others fail too, with a collective error)."""
        dead = [r.dead for r in self.replicas if r.dead]
        return next((d for d in dead if "exited" in d), dead[0] if dead else None)

    @property
    def info(self) -> EngineInfo | None:
        return self.replicas[0].info

    @property
    def streams(self) -> dict:
        return {k: v for r in self.replicas for k, v in r.streams.items()}

    @property
    def stats(self) -> EngineStats:
        return EngineStats.total([r.stats for r in self.replicas])

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        if self.listener is not None:            # after the replicas can take messages
            self.listener.start()
        if self.ray is not None:                 # after the head listens
            self.ray.start()

    async def wait_ready(self, timeout_s: float | None) -> None:
        await asyncio.gather(*(r.wait_ready(timeout_s) for r in self.replicas))
        self.ready.set()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()
        if self.listener is not None:
            self.listener.close()
        if self.ray is not None:
            self.ray.shutdown()

    def check_stalled(self) -> None:
        for r in self.replicas:
            r.check_stalled()

    def pick(self) -> CoreClient:
        return min(self.replicas, key=lambda r: (len(r.streams), r.stats.num_requests_waiting))

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        replica = self.pick()
        self.placement[request_id] = replica
        try:
            async for out in replica.generate(request_id, prompt, params, kv_transfer_params):
                yield out
        finally:
            self.placement.pop(request_id, None)

    async def free_remote(self, request_id: str, capability: str) -> bool:
        """The held request lives on one replica (which, nobody remembers): ask them all."""
        answers = await asyncio.gather(*(r.free_remote(request_id, capability)
                                         for r in self.replicas), return_exceptions=True)
        return any(a is True for a in answers)

    def abort(self, request_id: str) -> None:
        replica = self.placement.get(request_id)
        if replica is not None:
            replica.abort(request_id)
