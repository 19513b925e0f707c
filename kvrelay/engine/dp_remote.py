"""Data-parallel replicas on other nodes: the head's listener and the headless node.

    head (kvrelay serve -dp N -dpl L --data-parallel-rpc-port P)
        API server, replicas [0, L), HeadListener on address:P
    headless node (kvrelay serve -dp N -dpl L' --data-parallel-start-rank S --headless
                   --data-parallel-address HEAD --data-parallel-rpc-port P)
        replicas [S, S + L'), no API server; connects to the head and relays

Wire format: the length-prefixed JSON frames of `kvrelay/framing.py` (64 MiB at most) —
never pickle over the network; every frame is a message of `engine/messages.py`
(`to_wire`: {"type": tag, ...fields}). The headless node opens with

    Hello(version 2, Layout(data_parallel_size, tensor_parallel_size,
          enable_expert_parallel, model_config hash), start_rank S, local_size L')

and the head answers Welcome(master_port | None) or Reject(error) (the headless node
exits 1 with that message; the head logs it and keeps waiting). After that, both
directions carry the engine-core messages, with the replica's rank added as "replica".

Failure: a headless node that loses the head stops its replicas and exits 1; a head
that loses a headless node fails that node's replicas (the server then stops, as for
any dead replica). Shutdown: the head sends Shutdown to each remote replica; the
headless node stops its replicas and exits 0 when all have exited.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from kvrelay import envs, framing
from kvrelay.config import EngineArgs
from kvrelay.engine.async_client import CoreClient
from kvrelay.engine.client import EngineDeadError
from kvrelay.engine.core_proc import run_engine_core
from kvrelay.engine.dp_placement import replica_args
from kvrelay.engine.messages import (
    FROM_ENGINE,
    TO_ENGINE,
    CodecError,
    Fatal,
    Hello,
    Layout,
    Message,
    Reject,
    Shutdown,
    ToEngine,
    Welcome,
    from_wire,
    to_wire,
)
from kvrelay.framing import FrameError

logger = logging.getLogger(__name__)

VERSION = 2           # 2: the frames of engine/messages.py (typed messages, named fields)
MAX_FRAME = 64 << 20


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """One frame of the link; ConnectionError when the peer closed it."""
    frame = framing.recv_frame(sock, MAX_FRAME)
    if frame is None:
        raise ConnectionError("connection closed")
    return frame


def send_frame(sock: socket.socket, frame: dict[str, Any]) -> None:
    # NaN/inf allowed: a logprob may be -inf, and both ends are kvrelay
    framing.send_frame(sock, frame, MAX_FRAME, allow_nan=True)


# -- engine-core messages ⇄ frames -----------------------------------------------------------
def encode(message: Message, replica: int) -> dict[str, Any]:
    """An engine-core message (either direction) → the JSON frame for `replica`."""
    return {**to_wire(message), "replica": replica}


def decode(frame: dict[str, Any]) -> Message:
    return from_wire(frame)


def _replica_of(frame: dict[str, Any]) -> int | None:
    rank = frame.get("replica")
    return rank if isinstance(rank, int) else None


# -- the layout both sides must agree on -------------------------------------------------------
def _model_dir(args: EngineArgs):
    if args.model is None:
        from kvrelay.model.embedded import embedded_model_dir
        return embedded_model_dir()
    from kvrelay.model.loader import resolve_model_path
    return resolve_model_path(args.model, args.download_dir)


def layout_of(args: EngineArgs) -> Layout:
    raw = (_model_dir(args) / "config.json").read_bytes()
    return Layout(data_parallel_size=args.data_parallel_size,
                  tensor_parallel_size=args.tensor_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel,
                  model_config=hashlib.sha256(raw).hexdigest()[:16])


_FLAGS = {"data_parallel_size": "--data-parallel-size",
          "tensor_parallel_size": "--tensor-parallel-size",
          "enable_expert_parallel": "--enable-expert-parallel",
          "model_config": "the model's config.json"}


def check_hello(hello: Message, mine: Layout, claimed: set[int], head_local: int) -> list[int]:
    """The replica ranks a headless node may run, or ValueError naming the mismatch."""
    if not isinstance(hello, Hello) or hello.version != VERSION:
        version = hello.version if isinstance(hello, Hello) else None
        raise ValueError(f"expected a version {VERSION} hello, got {hello.tag!r} "
                         f"version {version!r}")
    for key, flag in _FLAGS.items():
        ours, theirs = getattr(mine, key), getattr(hello.layout, key)
        if theirs != ours:
            raise ValueError(f"{flag} differs: the head has {ours}, the headless node {theirs}")
    start, local = hello.start_rank, hello.local_size
    ranks = list(range(start, start + local))
    dp = mine.data_parallel_size
    if not ranks or start < head_local or start + local > dp:
        raise ValueError(f"replica ranks [{start}, {start + local}) are not in "
                         f"[{head_local}, {dp}) (the head runs ranks [0, {head_local}) of "
                         f"--data-parallel-size {dp})")
    taken = sorted(claimed & set(ranks))
    if taken:
        raise ValueError(f"replica rank {taken[0]} is already run by another headless node")
    return ranks


# -- head side ---------------------------------------------------------------------------------
class RemoteNode:
    """One connected headless node: the socket, a send lock, a reader thread."""

    def __init__(self, sock: socket.socket, replicas: dict[int, RemoteReplica]) -> None:
        self.sock, self.replicas = sock, replicas
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._reader, name="kvrelay-dp-node", daemon=True).start()

    def send(self, frame: dict[str, Any]) -> None:
        if self.closed:
            raise ConnectionError("the headless node is gone")
        with self.lock:
            send_frame(self.sock, frame)

    def _reader(self) -> None:
        why = "the headless node closed the connection"
        try:
            while True:
                frame = recv_frame(self.sock)
                replica = self.replicas.get(_replica_of(frame))  # type: ignore[arg-type]
                message = decode(frame)
                if not isinstance(message, FROM_ENGINE):
                    raise CodecError(f"a headless node sent {message.tag!r}")
                if replica is not None:
                    replica.receive(message)
        except (OSError, ValueError, KeyError, TypeError) as e:
            if not isinstance(e, ConnectionError) or str(e) != "connection closed":
                why = f"lost the headless node: {e}"
        self.closed = True
        for replica in self.replicas.values():
            replica.receive(Fatal(f"data-parallel replica {replica.rank}: {why}"))

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class RemoteReplica(CoreClient):
    """A replica run by a headless node: an engine core reached through its `RemoteNode`."""

    def __init__(self, rank: int, step_timeout_s: float | None = None) -> None:
        super().__init__(step_timeout_s)
        self.rank = rank
        self.node: RemoteNode | None = None

    def _deliver(self, message: ToEngine) -> None:
        if self.node is None:
            raise EngineDeadError(f"data-parallel replica {self.rank}: its headless node "
                                  f"has not connected")
        try:
            self.node.send(encode(message, self.rank))
        except OSError as e:
            raise EngineDeadError(f"data-parallel replica {self.rank}: {e}") from None

    def shutdown(self) -> None:
        self._stopping = True
        if self.node is not None and not self.node.closed:
            try:
                self.node.send(encode(Shutdown(), self.rank))
            except OSError:
                pass


class HeadListener:
    """Accepts headless nodes on --data-parallel-address:--data-parallel-rpc-port."""

    def __init__(self, args: EngineArgs, remote: list[RemoteReplica]) -> None:
        self.args, self.remote = args, {r.rank: r for r in remote}
        self.layout = layout_of(args)
        self.nodes: list[RemoteNode] = []
        self.claimed: set[int] = set()
        self.sock = socket.create_server((args.data_parallel_address, args.data_parallel_rpc_port))
        self.closed = False
        logger.info("waiting for headless nodes with data-parallel ranks [%d, %d) on %s:%d",
                    args.local_replicas, args.data_parallel_size, args.data_parallel_address,
                    args.data_parallel_rpc_port)

    def start(self) -> None:
        threading.Thread(target=self._accept, name="kvrelay-dp-listener", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._welcome, args=(conn, peer), daemon=True).start()

    def _welcome(self, conn: socket.socket, peer: tuple) -> None:
        conn.settimeout(30)
        try:
            hello = decode(recv_frame(conn))
            ranks = check_hello(hello, self.layout, self.claimed, self.args.local_replicas)
        except (OSError, ValueError) as e:
            logger.error("refused a headless node at %s:%d: %s", peer[0], peer[1], e)
            try:
                send_frame(conn, to_wire(Reject(str(e))))
            except OSError:
                pass
            conn.close()
            return
        self.claimed |= set(ranks)
        send_frame(conn, to_wire(Welcome(self.args.data_parallel_master_port)))
        conn.settimeout(None)
        node = RemoteNode(conn, {r: self.remote[r] for r in ranks})
        for r in ranks:
            self.remote[r].node = node
        self.nodes.append(node)
        logger.info("headless node %s:%d joined with data-parallel ranks %s", peer[0], peer[1],
                    ranks)

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        deadline = time.monotonic() + 15             # let the nodes stop their replicas
        for node in self.nodes:
            while not node.closed and time.monotonic() < deadline:
                time.sleep(0.05)
            node.close()


# -- headless side -----------------------------------------------------------------------------
def connect_to_head(args: EngineArgs, timeout_s: float) -> socket.socket:
    address, port = args.data_parallel_address, args.data_parallel_rpc_port
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((address, port), timeout=5)
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"cannot reach the data-parallel head at {address}:{port} "
                    f"(--data-parallel-address / --data-parallel-rpc-port): "
                    f"{e.strerror or e}; gave up after {timeout_s:.0f}s "
                    f"({envs.ENGINE_READY_TIMEOUT_S.shown})") from None
            time.sleep(0.5)


def run_headless(args: EngineArgs, signals: bool = True) -> int:
    """Run this node's replicas for the head; returns the exit code. `signals`: SIGTERM /
    SIGINT stop the replicas (a process of its own; not in a Ray actor, whose thread may
    not own the signals and which is stopped by the head's Shutdown or by Ray)."""
    timeout = envs.ENGINE_READY_TIMEOUT_S.as_float() or 600.0
    sock = connect_to_head(args, timeout)
    sock.settimeout(60)
    send_frame(sock, to_wire(Hello(VERSION, layout_of(args), args.data_parallel_start_rank,
                                   args.local_replicas)))
    answer = decode(recv_frame(sock))
    if not isinstance(answer, Welcome):
        sock.close()
        why = answer.error if isinstance(answer, Reject) else f"answered {answer.tag!r}"
        raise ValueError(f"the data-parallel head refused this node: {why}")
    sock.settimeout(None)
    args = replace(args, data_parallel_master_port=answer.master_port)
    start = args.data_parallel_start_rank
    ranks = range(start, start + args.local_replicas)
    ctx = mp.get_context("spawn")
    cores: dict[int, tuple[mp.process.BaseProcess, Connection]] = {}
    for r in ranks:
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=run_engine_core,
                        args=(replica_args(args, r), theirs, logging.getLogger().level),
                        name=f"kvrelay-engine-core-dp{r}", daemon=False)
        p.start()
        cores[r] = (p, mine)
    logger.info("headless: data-parallel ranks %s joined the head at %s:%d", list(ranks),
                args.data_parallel_address, args.data_parallel_rpc_port)
    return _relay(sock, cores, signals)


def _relay(sock: socket.socket, cores: dict[int, tuple[Any, Connection]],
           signals: bool = True) -> int:
    send_lock = threading.Lock()
    stopping = threading.Event()
    shut: set[int] = set()                                   # replicas told to shut down

    def pump(rank: int, conn: Connection) -> None:          # engine core → head
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                if stopping.is_set() or rank in shut:
                    return
                message = Fatal(f"the engine process of data-parallel replica {rank} exited")
            try:
                with send_lock:
                    send_frame(sock, encode(message, rank))
            except OSError:
                return
            if isinstance(message, Fatal):
                return

    for rank, (_, conn) in cores.items():
        threading.Thread(target=pump, args=(rank, conn), daemon=True).start()

    def on_signal(signum, _frame):
        stopping.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    if signals:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    rc = 0
    try:
        while len(shut) < len(cores):
            frame = recv_frame(sock)
            target = _replica_of(frame)
            if target is None or target not in cores:
                raise FrameError(f"message for replica {frame.get('replica')!r}, which this "
                                 f"node does not run")
            message = decode(frame)
            if not isinstance(message, TO_ENGINE):
                raise CodecError(f"the head sent {message.tag!r}")
            if isinstance(message, Shutdown):
                shut.add(target)
            try:
                cores[target][1].send(message)
            except OSError:
                pass
    except (OSError, ValueError) as e:
        if not stopping.is_set():
            logger.error("lost the data-parallel head: %s; stopping this node's replicas", e)
            rc = 1
    stopping.set()
    _stop_cores(cores)
    sock.close()
    return rc


def _stop_cores(cores: dict[int, tuple[Any, Connection]]) -> None:
    for _proc, conn in cores.values():
        try:
            conn.send(Shutdown())
        except OSError:
            pass
    deadline = time.monotonic() + 15
    for p, _ in cores.values():
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
