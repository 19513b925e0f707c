"""One TP rank's side of KV transfer: its transport and the READs it issues.

Owner of: this rank's transport (NIXL agent or TCP listener) with this rank's KV-cache
shard registered once, the prefill engines it can read from (one prefill rank each),
and its in-flight reads. Every rank has one `KVWorker`: rank 0 inside the engine
process (driven by `KVConnector`), ranks 1..N-1 in their worker processes (driven by
`serve_kv_message`, with a thread that reports finished reads and read-done notices).

    engine (rank 0)                              every rank
    ───────────────                              ──────────
    KVWorkerSetup ── broadcast once ───────────▶ make transport, register shard,
                  ◀── gather: transport metadata   reply metadata
    KVWork{peers, pulls, cancels} ── with the next step (or alone) ──▶ add_peer /
                                                   start_read (one per request) / release
                  ◀── LoadEvent / notices ──────── poll (rank 0: the engine; others: a thread)

The engine decides *which* blocks move (`PullOrder`, the same for every rank); each rank
turns the order into byte ranges of its own heads (`layout.head_slice`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvrelay import envs
from kvrelay.disagg.auth import load_secret, warn_if_exposed
from kvrelay.disagg.backends import make_transport
from kvrelay.disagg.capability import REFUSED, capability_matches, parse_notify
from kvrelay.disagg.layout import HeadSlice, head_slice
from kvrelay.disagg.params import KVTransferConfig
from kvrelay.disagg.side_channel import advertised_host
from kvrelay.disagg.tcp import TcpTransport
from kvrelay.disagg.transport import ReadDesc, TransferError

logger = logging.getLogger(__name__)

GRANT_WAIT_S = 2.0       # how long a rank waits for a read's grant to arrive from the engine


@dataclass(frozen=True)
class KVWorkerSetup:
    """What every rank needs to start its transport (broadcast once)."""
    config: KVTransferConfig
    engine_id: str
    num_kv_heads: int               # the model's, before sharding
    tp_size: int


@dataclass(frozen=True)
class PeerInfo:
    """A prefill engine as the handshake described it: each rank's transport metadata."""
    engine_id: str
    tp_size: int
    num_blocks: int                 # per rank (all ranks of an engine have the same count)
    ranks: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class GroupPull:
    """Blocks of one KV-cache group: remote_blocks[i] → local_blocks[i] in each of the
    group's `num_layers` layer tensors (hybrid groups share tensors 0..num_layers-1)."""
    num_layers: int
    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]


@dataclass(frozen=True)
class PullOrder:
    request_id: str                 # decode's request id (events name it)
    engine_id: str                  # the prefill engine to read from
    notify: bytes                   # reaches the prefill rank when this rank's read is done
    groups: tuple[GroupPull, ...]


@dataclass(frozen=True)
class ReadGrant:
    """Prefill side: a held request's capability and the block ids a peer may read for it
    (a TCP transport checks every read against these; NIXL reads are one-sided)."""
    request_id: str
    capability: str
    block_ids: frozenset[int]


@dataclass
class KVWork:
    """KV work for every rank, shipped with a step (`StepInput.kv_work`) or alone."""
    peers: list[PeerInfo] = field(default_factory=list)
    pulls: list[PullOrder] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    grants: list[ReadGrant] = field(default_factory=list)
    revokes: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.peers or self.pulls or self.cancels or self.grants or self.revokes)


@dataclass(frozen=True)
class LoadEvent:
    """A rank finished (or failed) its read for a request."""
    rank: int
    request_id: str
    error: str | None
    nbytes: int
    seconds: float = 0.0            # start_read → seen done by this rank
    started: float = 0.0            # time.monotonic() at start_read (one clock for all processes)


@dataclass
class _Read:
    handle: Any
    nbytes: int


def ucx_host(producer: bool, side_host: str | None) -> str | None:
    """The address whose interface UCX may listen on (None: leave UCX alone). A producer's
    is its side channel's advertised address (where decodes reach it). A pure consumer
    dials out, but UCX listens anyway: it gets the same restriction when
    VLLM_NIXL_SIDE_CHANNEL_HOST is set (every documented topology sets it on every server).
    Unset, the consumer's loopback default says nothing about where the prefills are, and
    restricting UCX to loopback would cut it off from prefills on other hosts. A
    UCX_NET_DEVICES the user set wins in both cases (nixl.restrict_ucx_interface)."""
    if producer:
        return advertised_host(side_host or "127.0.0.1")
    return advertised_host(side_host) if side_host else None


class KVWorker:
    def __init__(self, setup: KVWorkerSetup, rank: int, kv_tensors: list[Any]) -> None:
        cfg = setup.config
        self.setup, self.rank = setup, rank
        # a TCP transport serves reads where the side channel listens (0.0.0.0 in the tutorial)
        side_host = envs.SIDE_CHANNEL_HOST.raw()
        bind = (side_host or "127.0.0.1") if cfg.is_producer else "127.0.0.1"
        # UCX error mode "none": control traffic over shared memory, ~100x faster first read;
        # a vanished peer is still caught by the load timeout
        # (kv_connector_extra_config.load_timeout_s)
        options = cfg.extra.get("backend_options") or {"UCX": {"ucx_error_handling_mode": "none"}}
        secret = load_secret(cfg.extra)
        if cfg.is_producer and rank == 0:       # one warning per server (the side channel's too)
            warn_if_exposed(bind, secret, "KV transport")
        self.transport = make_transport(list(cfg.backends),
                                        agent_name=f"{setup.engine_id}-rank{rank}",
                                        host=bind, backend_options=options, secret=secret,
                                        serve=cfg.is_producer,
                                        ucx_host=ucx_host(cfg.is_producer, side_host))
        self.transport.register(kv_tensors)
        first = kv_tensors[0]                                     # [2, num_blocks, heads, B, hd]
        self.num_blocks, self.num_heads = first.shape[1], first.shape[2]
        self.head_bytes = first[0, 0, 0].nbytes                   # one head of one block
        self.peers: dict[str, tuple[PeerInfo, HeadSlice]] = {}
        self.peer_errors: dict[str, str] = {}
        self.reads: dict[str, _Read] = {}
        self._lock = threading.Lock()
        self.grants: dict[str, ReadGrant] = {}
        self._grants_changed = threading.Condition()
        if cfg.is_producer and isinstance(self.transport, TcpTransport):
            self.transport.authorize = self._authorize   # NIXL reads are one-sided: never asked

    @property
    def fell_back(self) -> bool:
        return bool(self.transport.fallback_from)

    def metadata(self) -> dict[str, Any]:
        return self.transport.metadata()

    # -- work from the engine ------------------------------------------------------------
    def apply(self, work: KVWork) -> list[LoadEvent]:
        """Add peers, cancel reads, start reads. Reads that cannot start are returned as
        failed events (the others report through `poll`)."""
        if work.grants or work.revokes:
            with self._grants_changed:
                self.grants.update((g.request_id, g) for g in work.grants)
                for request_id in work.revokes:
                    self.grants.pop(request_id, None)
                self._grants_changed.notify_all()
                expecting = bool(self.grants)
            self.transport.expect_reads(expecting)
        for peer in work.peers:
            self._add_peer(peer)
        for request_id in work.cancels:
            self.cancel(request_id)
        failed = []
        for order in work.pulls:
            if order.request_id in work.cancels:     # failed elsewhere before this rank started it
                continue
            try:
                self._start(order)
            except Exception as e:        # a bad peer or descriptor fails this request only
                failed.append(LoadEvent(self.rank, order.request_id, f"rank {self.rank}: {e}", 0))
        return failed

    def _add_peer(self, peer: PeerInfo) -> None:
        try:
            s = head_slice(peer.tp_size, self.setup.tp_size, self.setup.num_kv_heads, self.rank)
            if s.num_heads != self.num_heads:
                raise ValueError(f"this rank holds {self.num_heads} KV heads but reads "
                                 f"{s.num_heads}")
            self.transport.add_peer(peer.engine_id, peer.ranks[s.src_rank])
        except Exception as e:
            self.peer_errors[peer.engine_id] = f"cannot read from prefill {peer.engine_id}: {e}"
            logger.error("rank %d: %s", self.rank, self.peer_errors[peer.engine_id])
            return
        self.peer_errors.pop(peer.engine_id, None)
        self.peers[peer.engine_id] = (peer, s)

    def descs(self, order: PullOrder) -> list[Any]:
        """Byte ranges of this rank's heads for every block of the order:

            remote block r of tensor t, K/V kv:  [(kv·R + r)·Hs + off, … + n)·head_bytes
            local  block l:                      [(kv·L + l)·n, … + n)·head_bytes
        (R, L: blocks per tensor; Hs: heads per prefill block; off, n: this rank's slice.)"""
        peer, s = self.peers[order.engine_id]
        hb, n = self.head_bytes, s.num_heads
        out = []
        for g in order.groups:
            for remote, local in zip(g.remote_blocks, g.local_blocks):
                for tensor in range(g.num_layers):
                    for kv in (0, 1):
                        remote_row = (kv * peer.num_blocks + remote) * s.src_heads + s.src_offset
                        out.append(ReadDesc(tensor, remote_row * hb,
                                            (kv * self.num_blocks + local) * n * hb, n * hb))
        return out

    def _start(self, order: PullOrder) -> None:
        if order.engine_id not in self.peers:
            raise RuntimeError(self.peer_errors.get(order.engine_id,
                                                    f"no handshake with {order.engine_id}"))
        descs = self.descs(order)
        handle = self.transport.start_read(order.engine_id, descs, order.notify)
        with self._lock:
            self.reads[order.request_id] = _Read(handle, sum(d.nbytes for d in descs))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            read = self.reads.pop(request_id, None)
        if read is not None:
            self.transport.release(read.handle)

    def _authorize(self, notify: bytes, descs: list[tuple[int, int, int]]) -> str | None:
        """The TCP transport asks before serving a read: None if `notify` names a held
        request with its capability and every byte range lies inside one of the blocks
        issued for it; else why not. A grant sent to this rank may trail the decode's
        read by a step: wait for it a little."""
        parsed = parse_notify(notify)
        if parsed is None:
            return "a read must name its request and capability"
        request_id, _, capability = parsed
        deadline = time.monotonic() + GRANT_WAIT_S
        with self._grants_changed:
            while request_id not in self.grants and time.monotonic() < deadline:
                self._grants_changed.wait(deadline - time.monotonic())
            grant = self.grants.get(request_id)
        if grant is None or not capability_matches(capability, grant.capability):
            return REFUSED
        regions = self.transport.regions
        for region, offset, nbytes in descs:
            block_bytes = regions[region].nbytes // (2 * self.num_blocks)   # [2, blocks, ...]
            first, last = offset // block_bytes, (offset + nbytes - 1) // block_bytes
            if first != last or first % self.num_blocks not in grant.block_ids:
                return f"the read reaches beyond the blocks issued for request {request_id!r}"
        return None

    # -- progress --------------------------------------------------------------------------
    def poll(self) -> list[LoadEvent]:
        with self._lock:
            reads = list(self.reads.items())
        events = []
        for request_id, read in reads:
            try:
                if self.transport.poll(read.handle) == "pending":
                    continue
                error = None
            except TransferError as e:
                error = f"rank {self.rank}: {e}"
            with self._lock:
                if self.reads.pop(request_id, None) is None:
                    continue                                  # cancelled meanwhile
            self.transport.release(read.handle)
            events.append(LoadEvent(self.rank, request_id, error,
                                    read.nbytes if error is None else 0,
                                    time.monotonic() - read.handle.started_at,
                                    read.handle.started_at))
        return events

    def notifications(self) -> list[bytes]:
        return self.transport.take_notifications()

    def close(self) -> None:
        self.transport.close()


# ---------------------------------------------------------------------------------------
# ranks 1..N-1: the worker process's side


class WorkerKV:
    """A worker rank's `KVWorker` plus the thread that reports its progress to the engine
    over `events` (a multiprocessing queue): ("load", LoadEvent) and ("notify", [bytes])."""

    def __init__(self, setup: KVWorkerSetup, rank: int, kv_tensors: list[Any], events: Any) -> None:
        self.worker = KVWorker(setup, rank, kv_tensors)
        self.events = events
        events.cancel_join_thread()      # never block this process's exit on unread reports
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report, name=f"kvrelay-kv-rank{rank}",
                                        daemon=True)
        self._thread.start()

    def apply(self, work: KVWork) -> None:
        for event in self.worker.apply(work):
            self.events.put(("load", event))

    def _report(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self.worker.poll():
                    self.events.put(("load", event))
                notices = self.worker.notifications()
                if notices:
                    self.events.put(("notify", notices))
            except Exception as e:    # a closed transport at shutdown, or a bug: say so, keep going
                if self._stop.is_set():
                    return
                logger.warning("rank %d: KV progress thread: %s: %s", self.worker.rank,
                               type(e).__name__, e)
            # busy only while reads are in flight; otherwise look for notices 50 times a second
            time.sleep(0.0005 if self.worker.reads else 0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.worker.close()


def serve_kv_message(message: Any, state: WorkerKV | None, rank: int, kv_tensors: list[Any],
                     events: Any) -> WorkerKV | None:
    """A worker rank's handling of a non-step broadcast: `KVWorkerSetup` (make the
    transport, then gather its metadata to rank 0) or `KVWork`. Returns the new state."""
    import torch.distributed as dist
    if isinstance(message, KVWorkerSetup):
        try:
            state = WorkerKV(message, rank, kv_tensors, events)
            metadata = state.worker.metadata()
        except Exception as e:      # reported by the engine, which then stops every rank
            state, metadata = None, {"error": f"{type(e).__name__}: {e}"}
        dist.gather_object(metadata, None, dst=0)
        return state
    if isinstance(message, KVWork):
        if state is not None:
            state.apply(message)
        return state
    raise TypeError(f"rank {rank}: unexpected message {type(message).__name__}")


def drain(events: Any) -> list[tuple]:
    """Everything the worker ranks reported so far (non-blocking)."""
    out = []
    while True:
        try:
            out.append(events.get_nowait())
        except queue.Empty:
            return out
