"""KV transport over NIXL (one-sided READs, normally through its UCX backend).

NIXL is optional: this module imports without it; `NixlTransport(...)` raises
`TransportUnavailable` when it is missing or none of the requested backends loads.

How the NIXL calls map onto `KVTransport`:
- register: `register_memory(tensors)` (DRAM for CPU tensors, VRAM for CUDA tensors).
- metadata: `get_agent_metadata()` (base64 in the JSON dict) plus every region's
  (address, size, device id) so the reader can build remote descriptors.
- add_peer: `add_remote_agent(md)`.
- start_read: one NIXL transfer per call — local and remote descriptor lists built from
  the `ReadDesc`s (`get_xfer_descs` on an Nx3 array), `initialize_xfer("READ", ...,
  notif_msg=notify)`, `transfer`; poll: `check_xfer_state` ("PROC" → pending).
  NIXL merges adjacent descriptors itself.
- take_notifications: `get_new_notifs()`, flattened.

Progress: the agent runs without NIXL's progress thread. That thread polls its UCX worker
with a zero timeout (NIXL hard-codes `pthrDelay = 0`): about 0.2–0.4 of a core per idle
server. Instead NIXL progresses the worker inside `check_xfer_state` (the reader) and
`get_new_notifs` (the read side's target), and this transport runs its own pump thread —
one `get_new_notifs` every `PUMP_INTERVAL_S` — only while there is something to progress:
reads in flight here, a notification just sent, or (producer) reads expected because
blocks are held for decodes (`expect_reads`). The pump matters for UCX transports whose
GETs the target must serve (tcp); same-host shared memory/cma reads need no target
progress. Idle, the pump sleeps on a condition and costs nothing.
"""
from __future__ import annotations

import base64
import binascii
import ctypes
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kvrelay.disagg.side_channel import interface_addresses
from kvrelay.disagg.transport import (
    METADATA_VERSION,
    KVTransport,
    ReadDesc,
    ReadHandle,
    Region,
    TransferError,
    TransportUnavailable,
    check_descs,
    check_metadata,
    check_notify,
    tensor_regions,
)

logger = logging.getLogger(__name__)

# Backend init options applied unless the caller overrides them (NIXL wants str → str).
# UCX's "ucx_error_handling_mode" is left at NIXL's default ("peer": a dead peer is
# detected and reported); "none" moves UCX's control traffic to shared memory on one
# host, which makes the first transfer much faster (see docs / report).
DEFAULT_BACKEND_OPTIONS: dict[str, dict[str, str]] = {}

# The pump's period while armed: a tcp GET of 1 MiB took ~4 ms with a 1 ms pump and ~16 ms
# with a 10 ms one (2 loaded cores); one idle get_new_notifs costs a few microseconds.
PUMP_INTERVAL_S = 0.001
# how long the pump keeps going after a notification is sent (its UCX send may need it)
PUMP_LINGER_S = 0.05


_tamed = False


def _import_api() -> ModuleType:
    """`nixl._api`, imported with its logging side effects undone: NIXL's import logs INFO
    lines to stdout and sets the process-wide `logging.raiseExceptions = False`. Here its
    logger goes to stderr at WARNING (unless NIXL_LOG_LEVEL is set) and the flag is restored."""
    global _tamed
    raise_exc = logging.raiseExceptions
    try:
        from nixl import _api
    finally:
        logging.raiseExceptions = raise_exc
    if not _tamed:
        _tamed = True
        nixl_logger = logging.getLogger("nixl")
        if not os.environ.get("NIXL_LOG_LEVEL"):
            nixl_logger.setLevel(logging.WARNING)
        for h in nixl_logger.handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
                h.setStream(sys.stderr)
    return _api


def _avoid_exit_segfault() -> None:
    """NIXL 1.5.1's bundled UCX loads its InfiniBand module even on hosts without IB
    devices, and with it a bundled libnl-route whose destructor segfaults at process exit:
    every process that created a UCX backend would exit with SIGSEGV (status 139). On a
    host without IB devices, unless the user set UCX_MODULES, exclude UCX's ib modules
    (they have nothing to drive here). Must run before the first UCX backend is created."""
    if "UCX_MODULES" in os.environ:
        return
    try:
        with os.scandir("/sys/class/infiniband") as it:
            has_ib = any(True for _ in it)
    except OSError:
        has_ib = False
    if not has_ib:
        os.environ["UCX_MODULES"] = "^ib"


def ucx_interface(host: str) -> str | None:
    """The network interface that carries `host` (an IPv4 address): "lo" for loopback,
    else the interface holding that address; None when no interface does."""
    if host.startswith("127.") or host == "localhost":
        return "lo"
    for name, addr in interface_addresses():
        if addr == host:
            return name
    return None


def restrict_ucx_interface(host: str) -> None:
    """Make UCX (NIXL's UCX backend) open its network transports, and so listen, only on
    the interface of `host` — the side channel's advertised address — by setting
    UCX_NET_DEVICES before the first UCX context is created. Left to itself UCX listens
    on every interface's address. A UCX_NET_DEVICES the user set wins. Shared-memory
    transports (same host) are not network devices and stay available."""
    if os.environ.get("UCX_NET_DEVICES"):
        return
    iface = ucx_interface(host)
    if iface is None:
        logger.warning("NIXL/UCX: no interface holds the KV side channel's address %s; UCX may "
                       "listen on every interface (set UCX_NET_DEVICES to restrict it)", host)
        return
    os.environ["UCX_NET_DEVICES"] = iface
    logger.info("NIXL/UCX: network transports restricted to %s (the interface of %s); set "
                "UCX_NET_DEVICES to override", iface, host)


def nixl_import_error() -> str | None:
    """None when `nixl._api` imports, else why not (one line)."""
    try:
        _import_api()
    except Exception as e:  # ImportError, or a broken install raising something else
        return f"{type(e).__name__}: {e}"
    return None


def _nixl_api() -> ModuleType:
    try:
        return _import_api()
    except Exception as e:
        raise TransportUnavailable(f"NIXL is not installed or does not import "
                                   f"({type(e).__name__}: {e})") from e


def plugin_load_error(backend: str) -> str | None:
    """Best-effort reason why NIXL's plugin for `backend` does not load (a missing shared
    library, usually); None if the plugin file loads or cannot be found."""
    try:
        import nixl._api as api
        pkg_dir = os.path.dirname(os.path.dirname(api.__file__))
        pkg_name = os.path.basename(os.path.dirname(api.__file__))
    except Exception:
        return None
    name = f"libplugin_{backend}.so"
    for d in (os.path.join(pkg_dir, f".{pkg_name}.mesonpy.libs", "plugins"),
              os.path.join(pkg_dir, f"{pkg_name}.libs", "nixl")):
        path = os.path.join(d, name)
        if os.path.exists(path):
            try:
                ctypes.CDLL(path)
            except OSError as e:
                return str(e).replace(path + ": ", "")
            return None
    return None


@dataclass
class _Peer:
    agent: object                  # what add_remote_agent returned (NIXL gives bytes)
    agent_str: str
    md_b64: str
    regions: list[tuple[int, int, int]]     # (addr, nbytes, device id)
    mem_type: str


@dataclass(eq=False)
class NixlReadHandle(ReadHandle):
    xfer: object = None
    state: str = "pending"          # pending | done | error


class NixlTransport(KVTransport[NixlReadHandle]):
    name = "nixl"

    def __init__(self, agent_name: str | None = None, backends: Sequence[str] = ("UCX",),
                 backend_options: dict[str, dict[str, str]] | None = None,
                 ucx_host: str | None = None, progress_thread: bool = False) -> None:
        api = _nixl_api()
        if ucx_host is not None:
            restrict_ucx_interface(ucx_host)
        self.agent_name = agent_name or f"kvrelay-{uuid.uuid4().hex[:12]}"
        self._lock = threading.RLock()
        self._closed = False
        self._regions: list[Region] = []
        self._region_descs: list[tuple[int, int, int]] = []
        self._mem_type = "DRAM"
        self._reg_descs = None
        self._peers: dict[str, _Peer] = {}
        self._agents: dict[object, int] = {}     # remote agent → number of peer ids using it
        self._inflight: set[NixlReadHandle] = set()
        self._notifs: list[bytes] = []           # taken by the pump, not yet by the caller
        self._expecting = False
        self._linger_until = 0.0
        self._wake = threading.Condition(self._lock)
        self._pump: threading.Thread | None = None

        _avoid_exit_segfault()
        # without NIXL's busy progress thread unless asked for (see the module docstring)
        cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        try:
            self._agent = api.nixl_agent(self.agent_name, cfg)
        except Exception as e:
            raise TransportUnavailable(
                f"NIXL agent could not start: {type(e).__name__}: {e}") from e
        failed: dict[str, str] = {}
        applied: dict[str, dict[str, str]] = {}
        self.backends: list[str] = []
        for b in backends:
            b = str(b).upper()
            opts = dict(DEFAULT_BACKEND_OPTIONS.get(b, {}))
            opts.update((backend_options or {}).get(b, {}))
            opts = {str(k): str(v) for k, v in opts.items()}
            try:
                self._agent.create_backend(b, opts)
            except Exception as e:
                why = plugin_load_error(b) or f"{type(e).__name__}: {e}"
                failed[b] = why
                continue
            self.backends.append(b)
            applied[b] = opts
        if not self.backends:
            detail = "; ".join(f"{b}: {why}" for b, why in failed.items())
            del self._agent
            raise TransportUnavailable(
                f"NIXL could not create backend(s) {list(failed)} ({detail})")
        if failed:
            logger.warning("NIXL agent %s: backend(s) %s unavailable (%s); using %s",
                           self.agent_name, list(failed),
                           "; ".join(f"{b}: {w}" for b, w in failed.items()), self.backends)
        self.unavailable_backends = failed           # name → why it did not load
        self.backend_options = applied
        if not progress_thread:
            self._pump = threading.Thread(target=self._run_pump, daemon=True,
                                          name=f"kvrelay-nixl-pump-{self.agent_name}")
            self._pump.start()

    # -- progress ----------------------------------------------------------------------

    def expect_reads(self, active: bool) -> None:
        with self._lock:
            self._expecting = active
            self._wake.notify_all()

    def _armed(self) -> bool:
        return bool(self._inflight or self._expecting
                    or time.monotonic() < self._linger_until)

    def _run_pump(self) -> None:
        """Progress the UCX worker (and collect notifications) while armed; sleep otherwise."""
        while True:
            with self._lock:
                while not self._closed and not self._armed():
                    self._wake.wait()
                if self._closed:
                    return
                try:
                    self._collect()
                except TransferError as e:
                    logger.warning("NIXL progress: %s", e)
            time.sleep(PUMP_INTERVAL_S)

    def _collect(self) -> None:
        """get_new_notifs (which progresses the worker) into `_notifs`; under the lock."""
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            raise TransferError(f"NIXL get_new_notifs failed: {type(e).__name__}: {e}") from e
        self._notifs.extend(bytes(m) for msgs in notifs.values() for m in msgs)

    # -- registration ------------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            self._check_open()
            if self._regions:
                raise TransferError("NixlTransport.register() may be called only once")
            regions = tensor_regions(tensors)
            self._mem_type = "VRAM" if tensors[0].device.type == "cuda" else "DRAM"
            devs = [max(t.get_device(), 0) for t in tensors]
            try:
                self._reg_descs = self._agent.register_memory(list(tensors))
            except Exception as e:
                raise TransferError(f"NIXL could not register the KV tensors ({self._mem_type}): "
                                    f"{type(e).__name__}: {e}") from e
            self._tensors = list(tensors)          # keep them alive while registered
            self._regions = regions
            self._region_descs = [(r.addr, r.nbytes, d) for r, d in zip(regions, devs)]

    @property
    def regions(self) -> list[Region]:
        return list(self._regions)

    def metadata(self) -> dict:
        with self._lock:
            self._check_open()
            if not self._regions:
                raise TransferError("NixlTransport.metadata(): register() the KV tensors first")
            md = self._agent.get_agent_metadata()
            return {
                "transport": "nixl", "version": METADATA_VERSION, "agent_name": self.agent_name,
                "backends": list(self.backends), "mem_type": self._mem_type,
                "agent_metadata": base64.b64encode(md).decode("ascii"),
                "regions": [list(r) for r in self._region_descs],
            }

    # -- peers -------------------------------------------------------------------------

    def add_peer(self, peer_id: str, metadata: dict) -> None:
        md = check_metadata(metadata, "nixl", peer_id)
        b64 = md.get("agent_metadata")
        regions = md.get("regions")
        mem_type = md.get("mem_type")
        if not isinstance(b64, str):
            raise TransferError(f"peer {peer_id!r}: NIXL metadata lacks agent_metadata")
        if mem_type not in ("DRAM", "VRAM"):
            raise TransferError(f"peer {peer_id!r}: NIXL metadata has mem_type {mem_type!r}")
        if (not isinstance(regions, list) or not regions or not all(
                isinstance(r, list) and len(r) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r)
                for r in regions)):
            raise TransferError(f"peer {peer_id!r}: NIXL metadata regions must be a non-empty list "
                                f"of [addr, nbytes, device] non-negative integers")
        try:
            raw = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TransferError(f"peer {peer_id!r}: agent_metadata is not valid base64") from e
        with self._lock:
            self._check_open()
            old = self._peers.get(peer_id)
            if old is not None:
                if old.md_b64 == b64 and old.regions == [tuple(r) for r in regions]:
                    return
                self._drop_peer(peer_id)
            try:
                agent = self._agent.add_remote_agent(raw)
            except Exception as e:
                raise TransferError(f"peer {peer_id!r}: NIXL could not load the peer's agent "
                                    f"metadata ({type(e).__name__}: {e})") from e
            agent_str = agent.decode(errors="replace") if isinstance(agent, bytes) else str(agent)
            self._agents[agent] = self._agents.get(agent, 0) + 1
            self._peers[peer_id] = _Peer(agent, agent_str, b64, [tuple(r) for r in regions],
                                         mem_type)

    def remove_peer(self, peer_id: str) -> None:
        with self._lock:
            if peer_id in self._peers:
                self._drop_peer(peer_id)

    def _drop_peer(self, peer_id: str) -> None:
        for h in [h for h in self._inflight if h.peer_id == peer_id]:
            if h.state == "pending":
                h.state = "error"
                h.error = f"read from peer {peer_id!r} aborted: the peer was removed"
            if h.xfer is not None:
                self._release_xfer(h)
            self._inflight.discard(h)
        peer = self._peers.pop(peer_id)
        n = self._agents.get(peer.agent, 1) - 1
        if n > 0:
            self._agents[peer.agent] = n
            return
        self._agents.pop(peer.agent, None)
        self._settle()
        try:
            self._agent.remove_remote_agent(peer.agent)
        except Exception as e:
            logger.warning("NIXL: removing remote agent %s failed: %s", peer.agent_str, e)

    # -- reads -------------------------------------------------------------------------

    def start_read(self, peer_id: str, descs: Sequence[ReadDesc], notify: bytes) -> NixlReadHandle:
        notify = check_notify(notify)
        with self._lock:
            self._check_open()
            peer = self._peers.get(peer_id)
            if peer is None:
                raise TransferError(f"read from unknown peer {peer_id!r}: add_peer() it first")
            if not self._regions:
                raise TransferError("start_read: register() the local KV tensors first")
            total = check_descs(descs, [r.nbytes for r in self._regions],
                                [r[1] for r in peer.regions], peer_id)
            handle = NixlReadHandle(peer_id=peer_id, num_descs=len(descs), nbytes=total)
            if not descs:
                try:
                    self._agent.send_notif(peer.agent, notify)
                except Exception as e:
                    raise TransferError(f"NIXL notification to peer {peer_id!r} (agent "
                                        f"{peer.agent_str}) failed: {type(e).__name__}: {e}") from e
                handle.state, handle.finished_at = "done", time.monotonic()
                self._linger_until = time.monotonic() + PUMP_LINGER_S
                self._wake.notify_all()
                return handle
            n = len(descs)
            local = np.empty((n, 3), dtype=np.uint64)
            remote = np.empty((n, 3), dtype=np.uint64)
            for i, d in enumerate(descs):
                la, _, ldev = self._region_descs[d.region]
                ra, _, rdev = peer.regions[d.region]
                local[i] = (la + d.local_offset, d.nbytes, ldev)
                remote[i] = (ra + d.remote_offset, d.nbytes, rdev)
            try:
                ldl = self._agent.get_xfer_descs(local, self._mem_type)
                rdl = self._agent.get_xfer_descs(remote, peer.mem_type)
                xfer = self._agent.initialize_xfer("READ", ldl, rdl, peer.agent, notify)
            except Exception as e:
                raise TransferError(f"NIXL could not set up a READ of {n} descriptors ({total} "
                                    f"bytes) from peer {peer_id!r} (agent {peer.agent_str}): "
                                    f"{type(e).__name__}: {e}") from e
            handle.xfer = xfer
            try:
                state = self._agent.transfer(xfer)
            except Exception as e:
                self._release_xfer(handle)
                raise TransferError(f"NIXL READ from peer {peer_id!r} (agent {peer.agent_str}) "
                                    f"failed to start: {type(e).__name__}: {e}") from e
            if state == "ERR":
                self._release_xfer(handle)
                raise TransferError(f"NIXL READ from peer {peer_id!r} (agent {peer.agent_str}) "
                                    "failed to start (transfer returned ERR)")
            if state == "DONE":
                handle.state, handle.finished_at = "done", time.monotonic()
            self._inflight.add(handle)
            self._wake.notify_all()
            return handle

    def poll(self, handle: NixlReadHandle) -> str:
        if handle.state == "done":
            return "done"
        if handle.state == "error" or handle.released:
            raise TransferError(handle.error or f"read from peer {handle.peer_id!r} was released")
        with self._lock:
            if handle.state == "pending":
                try:
                    state = self._agent.check_xfer_state(handle.xfer)
                except Exception as e:
                    state, why = "ERR", f"{type(e).__name__}: {e}"
                else:
                    why = "the transfer reported ERR"
                if state == "DONE":
                    handle.state, handle.finished_at = "done", time.monotonic()
                elif state == "ERR":
                    peer = self._peers.get(handle.peer_id)
                    handle.state = "error"
                    handle.error = (f"NIXL READ of {handle.nbytes} bytes from peer "
                                    f"{handle.peer_id!r}"
                                    f"{f' (agent {peer.agent_str})' if peer else ''} failed: {why} "
                                    "(peer process gone or unreachable?)")
        if handle.state == "error":
            raise TransferError(handle.error)
        return "done" if handle.state == "done" else "pending"

    def release(self, handle: NixlReadHandle) -> None:
        with self._lock:
            if handle.released:
                return
            handle.released = True
            self._inflight.discard(handle)
            if handle.xfer is not None:
                self._release_xfer(handle)

    def _release_xfer(self, handle: NixlReadHandle) -> None:
        xfer, handle.xfer = handle.xfer, None
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as e:
            # NIXL could not cancel an active transfer: its handle is kept in the agent's
            # leak list and retried when the agent is destroyed.
            logger.warning("NIXL: releasing the READ handle for peer %r failed (%s: %s)",
                           handle.peer_id, type(e).__name__, e)

    def take_notifications(self) -> list[bytes]:
        with self._lock:
            if self._closed:
                return []
            self._collect()
            out, self._notifs = self._notifs, []
        return out

    # -- lifetime ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the NIXL transport is closed")

    def _settle(self) -> None:
        """Progress the worker a few rounds so UCX finishes what is queued (cancelled
        requests, endpoints of a dead peer): UCX asserts on destroying an endpoint with
        queued work, which its progress thread used to drain in the background."""
        for _ in range(3):
            try:
                self._collect()
            except TransferError as e:       # removing the peer (or closing) anyway
                logger.debug("NIXL progress before removing endpoints: %s", e)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
            pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout=5)        # it holds no lock while sleeping between rounds
        with self._lock:
            for h in list(self._inflight):
                h.released = True
                if h.xfer is not None:
                    self._release_xfer(h)
            self._inflight.clear()
            for peer_id in list(self._peers):
                self._drop_peer(peer_id)
            self._settle()
            if self._reg_descs is not None:
                try:
                    self._agent.deregister_memory(self._reg_descs)
                except Exception as e:
                    logger.warning("NIXL: deregistering the KV tensors failed: %s", e)
                self._reg_descs = None
            self._tensors = []
            del self._agent
