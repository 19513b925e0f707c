"""KV transport over plain TCP: the fallback where NIXL is not installed.

Every `TcpTransport` listens on (host, port) and serves reads of its registered
regions; a peer's `start_read` runs on a worker thread that sends one request and
receives the bytes straight into its own registered tensors.

Wire protocol (frames as in `side_channel`: 4-byte big-endian length + JSON object):
  → {"op": "read", "descs": [[region, offset, nbytes], ...], "notify": "<base64>"}
  ← {"ok": true, "nbytes": N} followed by N raw bytes (the descriptors' bytes in order),
     or {"ok": false, "error": "..."} (nothing follows; the connection stays usable)
  → {"op": "ack"}       once all bytes arrived: the server queues the notice for
                        take_notifications (no reply; like NIXL, the notice is delivered
                        after the reader saw its data, asynchronously)
  → {"op": "notify", "notify": "<base64>"}   a notice without data (an empty read)
  ← {"ok": true}
Both sides check every descriptor against the registered regions. CPU memory is sent
and received in place (gathered `sendmsg` / scattered `recvmsg_into` over views of the
tensors' storage); CUDA memory is staged through host buffers.
"""
from __future__ import annotations

import base64
import binascii
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from kvrelay.disagg.auth import AuthError, client_authenticate
from kvrelay.disagg.framed_server import FramedServer
from kvrelay.disagg.side_channel import advertised_host
from kvrelay.disagg.transport import (
    METADATA_VERSION,
    KVTransport,
    ReadDesc,
    ReadHandle,
    Region,
    TransferError,
    check_descs,
    check_metadata,
    check_notify,
    tensor_regions,
)
from kvrelay.framing import MAX_FRAME, FrameError, recv_frame, send_frame

logger = logging.getLogger(__name__)

MAX_DESCS = 1 << 20          # per read request
_IOV_BATCH = 512             # buffers per sendmsg / recvmsg_into call (IOV_MAX is 1024)
_STAGE_BYTES = 8 << 20       # host staging chunk for CUDA regions
MAX_CONNECTIONS = 64         # served connections (one thread each); readers pool a few per peer
IDLE_TIMEOUT_S = 120.0       # a served connection idle this long is closed
POOLED_MAX_AGE_S = 30.0      # readers reuse an idle connection only this long (< IDLE_TIMEOUT_S)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every view in order (gathered writes, partial sends handled)."""
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i:i + _IOV_BATCH]))


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order (scattered reads, partial receives handled)."""
    i = 0
    while i < len(views):
        got = sock.recvmsg_into(views[i:i + _IOV_BATCH])[0]
        if got == 0:
            raise ConnectionError("the peer closed the connection in the middle of the data")
        i = _advance(views, i, got)


def _advance(views: list[memoryview], i: int, done: int) -> int:
    """After `done` bytes went through views[i:]: the index of the first view not yet
    complete (a partly done one is trimmed to its rest)."""
    while done > 0 and i < len(views):
        n = views[i].nbytes
        if done >= n:
            done -= n
            i += 1
        else:
            views[i] = views[i][done:]
            done = 0
    return i


@dataclass
class _TcpPeer:
    host: str
    port: int
    regions: list[int]
    identity: str | None = None        # the identity it proves itself as (from its metadata)
    idle: list[tuple[socket.socket, float]] = field(default_factory=list)   # (socket, pooled at)


@dataclass(eq=False)
class TcpReadHandle(ReadHandle):
    future: Future | None = None
    sock: socket.socket | None = None
    cancelled: bool = False


class TcpTransport(KVTransport[TcpReadHandle]):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 30.0,
                 max_workers: int = 4, max_frame: int = MAX_FRAME, secret: bytes | None = None,
                 serve: bool = True, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout: float = IDLE_TIMEOUT_S, identity: str = "") -> None:
        self.host = host
        # who this transport is in the KV secret's handshake (both as server and as reader):
        # KVWorker passes its NIXL-style agent name "<engine id>-rank<r>"
        self.identity = identity
        self.timeout = timeout
        self.secret = secret            # peers authenticate (both directions) before any request
        self.serve_reads = serve        # False on a kv_consumer: its KV is nobody's to read
        self.idle_timeout = idle_timeout
        # set by the owner (KVWorker on a prefill): authorize(notify, descs) -> None to serve
        # the read, else the reason to refuse it
        self.authorize: Callable[[bytes, list[tuple[int, int, int]]], str | None] | None = None
        self.max_frame = max_frame
        self.max_descs = MAX_DESCS
        self._lock = threading.RLock()
        self._closed = False
        self._regions: list[Region] = []
        self._flat: list[torch.Tensor] = []         # uint8 views of the tensors
        self._views: list[memoryview | None] = []   # CPU regions: writable views of the storage
        self._peers: dict[str, _TcpPeer] = {}
        self._notifs: list[bytes] = []
        self._inflight: set[TcpReadHandle] = set()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-tcp-read")
        self._server = FramedServer(host, port, self._serve, label="TCP KV transport",
                                    name="kv-tcp", secret=secret,
                                    max_connections=max_connections,
                                    idle_timeout=idle_timeout, max_frame=max_frame,
                                    advertise_host=advertised_host(host), identity=identity)
        try:
            self._server.start()
        except OSError as e:
            self._pool.shutdown(wait=False)
            raise TransferError(f"TCP KV transport cannot listen on {host}:{port}: {e}") from e

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    # -- registration ------------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            self._check_open()
            if self._regions:
                raise TransferError("TcpTransport.register() may be called only once")
            regions = tensor_regions(tensors)
            flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
            self._views = [f.numpy().data.cast("B") if f.device.type == "cpu" else None
                           for f in flat]
            self._flat = flat
            self._regions = regions

    @property
    def regions(self) -> list[Region]:
        return list(self._regions)

    def metadata(self) -> dict:
        if not self._regions:
            raise TransferError("TcpTransport.metadata(): register() the KV tensors first")
        # host:port are the endpoint the listener proves itself for with a secret
        host, port = self._server.endpoint
        return {"transport": "tcp", "version": METADATA_VERSION, "host": host, "port": port,
                "regions": [r.nbytes for r in self._regions], "identity": self.identity}

    # -- serving reads (producer side) ------------------------------------------------

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            for msg in self._server.requests(conn, peer):
                conn.settimeout(self.timeout)
                self._handle_request(conn, msg)
                conn.settimeout(self.idle_timeout)  # readers pool idle connections for less
        except (OSError, ConnectionError) as e:
            if not self._server.stopping:
                logger.debug("TCP KV transport: connection from %s ended: %s", peer, e)
        except Exception as e:      # a malformed ack, or a bug: drop this connection only
            logger.warning("TCP KV transport: closing the connection from %s: %s: %s", peer,
                           type(e).__name__, e)

    def _handle_request(self, conn: socket.socket, msg: dict) -> None:
        op = msg.get("op")
        if not self.serve_reads:
            send_frame(conn, {"ok": False, "error": "this KV transport serves no reads"})
            return
        if op not in ("notify", "read"):
            send_frame(conn, {"ok": False, "error": f"unknown op {op!r}"})
            return
        try:
            descs = self._check_request(msg.get("descs")) if op == "read" else []
            note = self._check_notify(msg.get("notify"))
            refused = self.authorize(note, descs) if self.authorize is not None else None
            if refused:
                raise TransferError(refused)
            if op == "notify":
                with self._lock:
                    self._notifs.append(note)
                send_frame(conn, {"ok": True})
                return
        except TransferError as e:
            send_frame(conn, {"ok": False, "error": str(e)})
            return
        self._send_data(conn, descs)
        ack = recv_frame(conn, self.max_frame)
        if ack is None or ack.get("op") != "ack":
            raise ConnectionError(f"expected the reader's ack, got {str(ack)[:100]}")
        with self._lock:
            self._notifs.append(note)

    @staticmethod
    def _check_notify(b64: Any) -> bytes:   # a JSON value, checked here
        try:
            note = base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TransferError("notify must be base64") from None
        return check_notify(note)

    def _send_data(self, conn: socket.socket, descs: list[tuple[int, int, int]]) -> None:
        total = sum(n for _, _, n in descs)
        send_frame(conn, {"ok": True, "nbytes": total})
        views, staged = [], 0
        for region, off, n in descs:
            v = self._views[region]
            if v is not None:
                views.append(v[off:off + n])
                continue
            # CUDA region: copy to host in chunks
            for s in range(off, off + n, _STAGE_BYTES):
                e = min(off + n, s + _STAGE_BYTES)
                views.append(self._flat[region][s:e].cpu().numpy().data.cast("B"))
                staged += e - s
            if staged > _STAGE_BYTES:
                _send_views(conn, views)
                views, staged = [], 0
        _send_views(conn, views)

    def _check_request(self, descs: object) -> list[tuple[int, int, int]]:
        if not self._regions:
            raise TransferError("this side has not registered any KV tensors yet")
        if not isinstance(descs, list):
            raise TransferError("descs must be a list of [region, offset, nbytes]")
        if len(descs) > self.max_descs:
            raise TransferError(f"{len(descs)} descriptors exceed the limit of {self.max_descs}")
        out = []
        for i, d in enumerate(descs):
            if not (isinstance(d, list) and len(d) == 3 and all(_is_int(v) for v in d)):
                raise TransferError(f"descriptor {i} must be [region, offset, nbytes] integers")
            region, off, n = d
            if not 0 <= region < len(self._regions):
                raise TransferError(f"descriptor {i}: region {region} does not exist "
                                    f"({len(self._regions)} registered)")
            size = self._regions[region].nbytes
            if off < 0 or n <= 0 or off + n > size:
                raise TransferError(f"descriptor {i}: bytes [{off}, {off + n}) are outside region "
                                    f"{region} ({size} bytes)")
            out.append((region, off, n))
        return out

    # -- peers -------------------------------------------------------------------------

    def add_peer(self, peer_id: str, metadata: dict) -> None:
        md = check_metadata(metadata, "tcp", peer_id)
        host, port, regions = md.get("host"), md.get("port"), md.get("regions")
        identity = md.get("identity") if isinstance(md.get("identity"), str) else None
        if not isinstance(host, str) or not host:
            raise TransferError(f"peer {peer_id!r}: TCP metadata lacks a host")
        if not _is_int(port) or not 0 < port < 65536:
            raise TransferError(f"peer {peer_id!r}: TCP metadata has port {port!r}")
        if (not isinstance(regions, list) or not regions
                or not all(_is_int(r) and r > 0 for r in regions)):
            raise TransferError(f"peer {peer_id!r}: TCP metadata regions must be a non-empty list "
                                "of positive sizes")
        with self._lock:
            self._check_open()
            old = self._peers.get(peer_id)
            if old is not None:
                if (old.host, old.port, old.regions, old.identity) == (host, port, regions,
                                                                       identity):
                    return
                self._close_idle(old)
            self._peers[peer_id] = _TcpPeer(host, port, list(regions), identity)

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(peer_id, None)
            if peer is not None:
                self._close_idle(peer)

    @staticmethod
    def _close_idle(peer: _TcpPeer) -> None:
        for s, _ in peer.idle:
            try:
                s.close()
            except OSError:
                pass
        peer.idle.clear()

    # -- reads (consumer side) ---------------------------------------------------------

    def start_read(self, peer_id: str, descs: Sequence[ReadDesc], notify: bytes) -> TcpReadHandle:
        notify = check_notify(notify)
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                raise TransferError(f"read from unknown peer {peer_id!r}: add_peer() it first")
            if not self._regions:
                raise TransferError("start_read: register() the local KV tensors first")
            total = check_descs(descs, [r.nbytes for r in self._regions], peer.regions, peer_id)
            handle = TcpReadHandle(peer_id=peer_id, num_descs=len(descs), nbytes=total)
            descs = list(descs)
            handle.future = self._pool.submit(self._do_read, handle, peer, descs, notify)
            self._inflight.add(handle)
        return handle

    def _connect(self, peer: _TcpPeer) -> socket.socket:
        now = time.monotonic()
        with self._lock:
            while peer.idle:
                s, since = peer.idle.pop()
                if now - since < POOLED_MAX_AGE_S:
                    return s
                self._discard(s)           # the server may have closed it by now
        try:
            s = socket.create_connection((peer.host, peer.port), timeout=self.timeout)
        except OSError as e:
            raise TransferError(f"TCP KV transport cannot connect to {peer.host}:{peer.port} "
                                f"({type(e).__name__}: {e})") from e
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.secret is not None:
            try:
                # the endpoint exactly as dialed: a listener proving for another is refused
                client_authenticate(s, self.secret, endpoint=(peer.host, peer.port),
                                    identity=self.identity, expect_id=peer.identity)
            except AuthError as e:
                self._discard(s)
                raise TransferError(f"TCP KV transport {peer.host}:{peer.port}: {e} (is "
                                    f"KVRELAY_KV_SECRET the same on every server?)") from None
        return s

    def _do_read(self, handle: TcpReadHandle, peer: _TcpPeer, descs: list[ReadDesc],
                 notify: bytes) -> None:
        where = f"peer {handle.peer_id!r} ({peer.host}:{peer.port})"
        sock = None
        try:
            if handle.cancelled:
                raise TransferError("cancelled")
            sock = self._connect(peer)
            sock.settimeout(self.timeout)
            handle.sock = sock
            if handle.cancelled:        # release() raced with the connect
                raise TransferError("cancelled")
            note = base64.b64encode(notify).decode("ascii")
            if descs:
                send_frame(sock, {"op": "read", "notify": note,
                                  "descs": [[d.region, d.remote_offset, d.nbytes] for d in descs]},
                           self.max_frame)
            else:
                send_frame(sock, {"op": "notify", "notify": note})
            reply = recv_frame(sock, self.max_frame)
            if reply is None:
                raise TransferError(f"TCP KV read from {where}: connection closed without a reply")
            if reply.get("ok") is not True:
                raise TransferError(f"TCP KV read from {where} refused: {reply.get('error')}")
            if descs:
                if reply.get("nbytes") != handle.nbytes:
                    raise TransferError(f"TCP KV read from {where}: peer announced "
                                        f"{reply.get('nbytes')!r} bytes, expected {handle.nbytes}")
                self._receive(sock, descs)
                send_frame(sock, {"op": "ack"})
        except TransferError as e:
            self._discard(sock)
            if handle.cancelled:
                raise TransferError(f"TCP KV read from {where} was cancelled") from None
            if str(e).startswith("TCP KV"):
                raise
            raise TransferError(f"TCP KV read from {where}: {e}") from None
        except (OSError, ConnectionError, FrameError) as e:
            self._discard(sock)
            if handle.cancelled:
                raise TransferError(f"TCP KV read from {where} was cancelled") from None
            raise TransferError(
                f"TCP KV read from {where} failed: {type(e).__name__}: {e}") from None
        finally:
            handle.sock = None
        handle.finished_at = time.monotonic()
        with self._lock:
            if not self._closed and peer is self._peers.get(handle.peer_id):
                sock.settimeout(None)
                peer.idle.append((sock, time.monotonic()))
            else:
                self._discard(sock)

    def _receive(self, sock: socket.socket, descs: list[ReadDesc]) -> None:
        views: list[memoryview] = []
        for d in descs:
            v = self._views[d.region]
            if v is not None:
                views.append(v[d.local_offset:d.local_offset + d.nbytes])
                continue
            _recv_views(sock, views)
            views = []
            for s in range(0, d.nbytes, _STAGE_BYTES):
                n = min(_STAGE_BYTES, d.nbytes - s)
                stage = torch.empty(n, dtype=torch.uint8)
                _recv_views(sock, [stage.numpy().data.cast("B")])
                lo = d.local_offset + s
                self._flat[d.region][lo:lo + n].copy_(stage)
        _recv_views(sock, views)

    @staticmethod
    def _discard(sock: socket.socket | None) -> None:
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def poll(self, handle: TcpReadHandle) -> str:
        if handle.released:
            raise TransferError(f"read from peer {handle.peer_id!r} was released")
        fut = handle.future
        if fut is None or not fut.done():
            return "pending"
        exc = fut.exception()
        if exc is not None:
            handle.error = str(exc)
            if isinstance(exc, TransferError):
                raise exc
            raise TransferError(f"TCP KV read from peer {handle.peer_id!r} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        return "done"

    def release(self, handle: TcpReadHandle) -> None:
        if handle.released:
            return
        handle.released = True
        fut = handle.future
        if fut is not None and not fut.done():
            handle.cancelled = True
            fut.cancel()
            sock = handle.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            try:            # after this, no more bytes land in local memory
                fut.exception(timeout=self.timeout + 5)
            except Exception:
                pass
        with self._lock:
            self._inflight.discard(handle)

    def take_notifications(self) -> list[bytes]:
        with self._lock:
            out, self._notifs = self._notifs, []
        return out

    # -- lifetime ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the TCP KV transport is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._server.stop()
            inflight = list(self._inflight)
        for h in inflight:
            self.release(h)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for peer in self._peers.values():
                self._close_idle(peer)
            self._peers.clear()
        self._server.close()
        self._views, self._flat = [], []
