"""The KV transport: one-sided, batched reads of registered KV memory from a peer.

One `KVTransport` per rank. The producer (prefill) registers its KV tensors and
publishes `metadata()` over the side channel; the consumer (decode) registers its own
KV tensors, `add_peer`s the producer's metadata and pulls bytes with `start_read`,
polling the returned handle until it is done. When a read completes, the producer
receives the read's `notify` message through `take_notifications()` (the signal that
its blocks may be freed).

A `ReadDesc` names a region by index (the same index on both sides: the i-th
registered tensor) and byte offsets into it on each side. Every descriptor is checked
against both sides' registered regions before anything moves: a bad one is a
`TransferError`, never an out-of-bounds access.

Implementations: `NixlTransport` (NIXL, normally its UCX backend; `nixl.py`) and
`TcpTransport` (plain TCP scatter/gather, for machines without NIXL; `tcp.py`).
`backends.make_transport` picks one from the configured backend names, falling back
(with a logged WARNING and `.fallback_from` set) when the requested one is unavailable.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Self, TypeVar

import torch

logger = logging.getLogger(__name__)

METADATA_VERSION = 1
MAX_NOTIFY_BYTES = 64 * 1024


class TransferError(RuntimeError):
    """A KV transfer (or its setup) failed; the message says what and where."""


class TransportUnavailable(RuntimeError):
    """The requested transport (NIXL, or one of its backends) cannot be used here."""


@dataclass(frozen=True)
class Region:
    """One registered memory region (a KV tensor)."""
    addr: int
    nbytes: int


@dataclass(frozen=True)
class ReadDesc:
    """Copy `nbytes` from the peer's region `region` at `remote_offset` into this side's
    region `region` at `local_offset`."""
    region: int
    remote_offset: int
    local_offset: int
    nbytes: int


@dataclass(eq=False)
class ReadHandle:
    """What `start_read` returns. Timing fields are for metrics (monotonic seconds)."""
    peer_id: str
    num_descs: int
    nbytes: int
    started_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    released: bool = False
    error: str | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at


H = TypeVar("H", bound=ReadHandle)


class KVTransport(ABC, Generic[H]):
    """One per rank. Safe to call from several threads (each method takes a lock).
    `H`: the transport's own ReadHandle subclass, which only it accepts back."""

    name: str                       # "nixl" | "tcp"
    fallback_from: str | None = None    # set by make_transport when it fell back

    @abstractmethod
    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register the KV tensors (contiguous, CPU or CUDA), once."""

    @property
    @abstractmethod
    def regions(self) -> list[Region]:
        """This side's registered regions, in registration order."""

    @abstractmethod
    def metadata(self) -> dict:
        """JSON-able: what a peer needs to read from this side."""

    @abstractmethod
    def add_peer(self, peer_id: str, metadata: dict) -> None:
        """Make a remote transport readable (idempotent; new metadata replaces old)."""

    @abstractmethod
    def remove_peer(self, peer_id: str) -> None: ...

    @abstractmethod
    def start_read(self, peer_id: str, descs: Sequence[ReadDesc], notify: bytes) -> H:
        """Start one batched one-sided READ; `notify` reaches the peer when it is done.
        An empty `descs` only delivers `notify`."""

    @abstractmethod
    def poll(self, handle: H) -> str:
        """"pending" or "done"; raises TransferError if the read failed."""

    @abstractmethod
    def release(self, handle: H) -> None:
        """Free the handle; an unfinished read is cancelled first (best effort for NIXL;
        for TCP no byte lands in local memory after release returns)."""

    @abstractmethod
    def take_notifications(self) -> list[bytes]:
        """Producer side: notify messages of reads that peers completed since last call."""

    def expect_reads(self, active: bool) -> None:
        """Producer: whether peers may read now (blocks are held for them). A transport
        whose serving side needs driving (NIXL without its own progress thread) keeps it
        going meanwhile; the others ignore this."""

    @abstractmethod
    def close(self) -> None: ...

    def wait(self, handle: H, timeout: float = 30.0, interval: float = 0.0005) -> None:
        """Poll until done (tests, tools); TransferError on failure or timeout."""
        deadline = time.monotonic() + timeout
        while self.poll(handle) != "done":
            if time.monotonic() > deadline:
                raise TransferError(f"KV read from peer {handle.peer_id!r} not done after "
                                    f"{timeout:.0f}s")
            time.sleep(interval)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# helpers shared by the implementations


def tensor_regions(tensors: Sequence[torch.Tensor]) -> list[Region]:
    """Regions of `tensors`, checking that they can be registered."""
    if not tensors:
        raise ValueError("register() needs at least one tensor")
    device_type = tensors[0].device.type
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KV region {i}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"KV region {i}: tensor must be contiguous (shape {tuple(t.shape)})")
        if t.device.type != device_type:
            raise ValueError(f"KV region {i}: all tensors must be on one device type "
                             f"({t.device} vs {tensors[0].device})")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KV region {i}: device {t.device} is not supported (cpu or cuda)")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            raise ValueError(f"KV region {i}: tensor is empty")
        out.append(Region(addr=t.data_ptr(), nbytes=nbytes))
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_descs(descs: Sequence[ReadDesc], local: Sequence[int], remote: Sequence[int],
                peer_id: str) -> int:
    """Check every descriptor against the local and remote region sizes; total bytes."""
    total = 0
    for i, d in enumerate(descs):
        if not isinstance(d, ReadDesc):
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} is a "
                                f"{type(d).__name__}, not a ReadDesc")
        if not all(_is_int(v) for v in (d.region, d.remote_offset, d.local_offset, d.nbytes)):
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} has non-integer "
                                f"fields: {d}")
        if d.nbytes <= 0 or d.remote_offset < 0 or d.local_offset < 0:
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} has a negative offset "
                                f"or non-positive size: {d}")
        if not 0 <= d.region < len(local):
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} names region "
                                f"{d.region}, but this side registered {len(local)} regions")
        if d.region >= len(remote):
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} names region "
                                f"{d.region}, but the peer registered {len(remote)} regions")
        if d.local_offset + d.nbytes > local[d.region]:
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} writes bytes "
                                f"[{d.local_offset}, {d.local_offset + d.nbytes}) of local region "
                                f"{d.region}, which has {local[d.region]} bytes")
        if d.remote_offset + d.nbytes > remote[d.region]:
            raise TransferError(f"read from peer {peer_id!r}: descriptor {i} reads bytes "
                                f"[{d.remote_offset}, {d.remote_offset + d.nbytes}) of the peer's "
                                f"region {d.region}, which has {remote[d.region]} bytes")
        total += d.nbytes
    return total


def check_notify(notify: bytes) -> bytes:
    if isinstance(notify, str):
        notify = notify.encode()
    if not isinstance(notify, (bytes, bytearray, memoryview)):
        raise TransferError(f"notify must be bytes, got {type(notify).__name__}")
    notify = bytes(notify)
    if len(notify) > MAX_NOTIFY_BYTES:
        raise TransferError(f"notify message of {len(notify)} bytes exceeds {MAX_NOTIFY_BYTES}")
    return notify


def check_metadata(metadata: object, expected: str, peer_id: str) -> dict:
    """Common checks of a peer's metadata dict."""
    if not isinstance(metadata, dict):
        raise TransferError(f"peer {peer_id!r}: transport metadata must be a dict, "
                            f"got {type(metadata).__name__}")
    kind = metadata.get("transport")
    if kind != expected:
        raise TransferError(
            f"peer {peer_id!r} uses KV transport {kind!r} but this side uses {expected!r}: both "
            f"sides must use the same transport (check the kv_connector_extra_config backends and "
            f"whether NIXL is installed on both hosts)")
    if metadata.get("version") != METADATA_VERSION:
        raise TransferError(f"peer {peer_id!r}: transport metadata version "
                            f"{metadata.get('version')!r}, this side speaks {METADATA_VERSION}")
    return metadata


# ---------------------------------------------------------------------------------------
# choosing a transport
