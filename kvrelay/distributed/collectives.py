"""Collectives over torch.distributed process groups (gloo on CPU, NCCL on CUDA).

    TorchDistCollectives   one replica's tensor-parallel ranks (the default world a
                           `MultiprocExecutor` creates)
    GlooExpertGroup        every rank of every data-parallel replica: expert
                           parallelism across replicas (EP = TP × DP). A separate world
                           (its own TCPStore + ProcessGroupGloo), so a replica's TP world
                           stays as it is and the replicas may live on several machines.
    ReplicaSync            the replicas' engine cores (one per replica): the per-step
                           "who has work" exchange of lockstep stepping (engine/lockstep.py)

Both cross-replica groups rendezvous at `ExpertWorld.address:port`; the TCPStore is
served by global rank 0 (replica 0's engine core).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvrelay.model.parallel import Collectives, ExpertGroup


class TorchDistCollectives(Collectives):
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # reduce in float32: exact enough for token-identical TP, and gloo-friendly
        buf = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(buf, group=self.group)
        return buf.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class ExpertWorld:
    """Where and how the ranks of all replicas meet (picklable; sent to every rank)."""

    address: str              # --data-parallel-address (the head node)
    port: int                 # the TCPStore of the expert world (chosen by the head)
    dp_rank: int              # this replica
    dp_size: int
    tp_size: int
    timeout_s: float = 600.0

    @property
    def size(self) -> int:
        return self.dp_size * self.tp_size

    def global_rank(self, tp_rank: int) -> int:
        return self.dp_rank * self.tp_size + tp_rank


def _store(world: ExpertWorld, is_master: bool) -> tuple[dist.Store, socket.socket | None]:
    """The rendezvous store; the master serves it on `address` only (a TCPStore left to
    itself listens on every interface)."""
    listener = socket.create_server((world.address, world.port)) if is_master else None
    store = dist.TCPStore(world.address, world.port, None, is_master,
                          timeout=timedelta(seconds=world.timeout_s), wait_for_workers=False,
                          master_listen_fd=listener.fileno() if listener else None)
    return store, listener


def _gloo(store: dist.Store, prefix: str, rank: int, size: int,
          world: ExpertWorld) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, no stubs
    device = dist.ProcessGroupGloo.create_device(hostname=local_address_towards(world.address))
    opts._devices = [device]
    opts._timeout = timedelta(seconds=world.timeout_s)
    # the stubs call ProcessGroupGloo a Backend; it is used (and works) as a process group
    return dist.ProcessGroupGloo(  # type: ignore[return-value]
        dist.PrefixStore(prefix, store), rank, size, opts)


def local_address_towards(address: str) -> str:
    """This machine's address on the route to `address` (127.0.0.1 for loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))               # no packet is sent for a UDP connect
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class GlooExpertGroup(ExpertGroup):
    """All tp_size × dp_size ranks; collectives in float32 (exact for bf16/fp32 inputs)."""

    def __init__(self, world: ExpertWorld, tp_rank: int) -> None:
        super().__init__()
        self.size, self.rank = world.size, world.global_rank(tp_rank)
        self.store, self._listener = _store(world, is_master=self.rank == 0)
        self.pg = _gloo(self.store, "experts", self.rank, self.size, world)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=0)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        parts = list(x.float().contiguous().chunk(self.size, dim=0))
        out = torch.empty_like(parts[0])
        self.pg.reduce_scatter([out], [parts]).wait()
        return out.to(dtype)


class ReplicaSync:
    """The replicas' engine cores: one small all-gather of int64 rows per step."""

    def __init__(self, world: ExpertWorld) -> None:
        self.store, _ = _store(world, is_master=False)
        self.pg = _gloo(self.store, "replicas", world.dp_rank, world.dp_size, world)
        self.size = world.dp_size

    def all_gather(self, row: list[int]) -> list[list[int]]:
        x = torch.tensor(row, dtype=torch.int64)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return [p.tolist() for p in parts]
