"""Data parallelism: N engine replicas behind one API server.

Owner of: the replicas (each an `AsyncEngine`: its own engine-core process, scheduler,
KV cache and tensor-parallel ranks) and the placement of requests. A request goes to
the replica with the fewest requests in flight (ties: fewest waiting in its scheduler),
and stays there. It offers `AsyncEngine`'s interface, so the server does not know.

Replica r's device slice is the r-th equal share of the visible devices. Expert
parallelism across replicas (lockstep MoE steps) is not built yet and is refused.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from kvrelay import envs
from kvrelay.config import EngineArgs
from kvrelay.engine.async_client import AsyncEngine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams


def replica_devices(visible: str | None, dp: int, rank: int) -> str | None:
    if not visible:
        return None
    ids = envs.parse_id_list(visible)
    if len(ids) < dp:                      # more replicas than devices: share round-robin
        return str(ids[rank % len(ids)])
    per = len(ids) // dp
    return ",".join(str(i) for i in ids[rank * per:(rank + 1) * per])


class DataParallelEngine:
    def __init__(self, args: EngineArgs, step_timeout_s: float | None = None) -> None:
        if args.enable_expert_parallel:
            raise ValueError("--data-parallel-size > 1 with --enable-expert-parallel (experts sharded "
                             "across replicas) is not supported yet; drop one of the two flags")
        visible = envs.VISIBLE_DEVICES.raw()
        self.replicas = [AsyncEngine(replace(args, data_parallel_size=1,
                                             visible_devices=replica_devices(visible, args.data_parallel_size, r)),
                                     step_timeout_s)
                         for r in range(args.data_parallel_size)]
        self.ready = asyncio.Event()
        self.placement: dict[str, AsyncEngine] = {}

    # -- the AsyncEngine interface ---------------------------------------------------------
    @property
    def dead(self) -> str | None:
        return next((r.dead for r in self.replicas if r.dead), None)

    @property
    def info(self) -> dict[str, Any]:
        return self.replicas[0].info

    @property
    def streams(self) -> dict:
        return {k: v for r in self.replicas for k, v in r.streams.items()}

    @property
    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for r in self.replicas:
            for k, v in r.stats.items():
                total[k] = total.get(k, 0) + v
        if total:
            total["kv_cache_usage_perc"] = total.get("kv_cache_usage_perc", 0) / len(self.replicas)
        return total

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    async def wait_ready(self, timeout_s: float | None) -> None:
        await asyncio.gather(*(r.wait_ready(timeout_s) for r in self.replicas))
        self.ready.set()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

    def check_stalled(self) -> None:
        for r in self.replicas:
            r.check_stalled()

    def pick(self) -> AsyncEngine:
        return min(self.replicas, key=lambda r: (len(r.streams), r.stats.get("num_requests_waiting", 0)))

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        replica = self.pick()
        self.placement[request_id] = replica
        try:
            async for out in replica.generate(request_id, prompt, params, kv_transfer_params):
                yield out
        finally:
            self.placement.pop(request_id, None)

    def free_remote(self, request_id: str) -> None:
        for r in self.replicas:
            r.free_remote(request_id)

    def abort(self, request_id: str) -> None:
        replica = self.placement.get(request_id)
        if replica is not None:
            replica.abort(request_id)
