"""Where a data-parallel replica runs on its node: its engine arguments and device slice.
Used by the head (`data_parallel.py`) and by headless nodes (`dp_headless.py`) alike."""
from __future__ import annotations

from dataclasses import replace

from kvrelay import envs
from kvrelay.config import EngineArgs


def replica_devices(visible: str | None, dp: int, rank: int) -> str | None:
    if not visible:
        return None
    ids = envs.parse_id_list(visible)
    if len(ids) < dp:                      # more replicas than devices: share round-robin
        return str(ids[rank % len(ids)])
    per = len(ids) // dp
    return ",".join(str(i) for i in ids[rank * per:(rank + 1) * per])


def replica_args(args: EngineArgs, rank: int) -> EngineArgs:
    """The engine arguments of replica `rank` on this node (its device slice among
    this node's replicas)."""
    visible = envs.VISIBLE_DEVICES.raw()
    local_index = rank - args.data_parallel_start_rank
    return replace(args, data_parallel_rank=rank,
                   visible_devices=replica_devices(visible, args.local_replicas, local_index))
