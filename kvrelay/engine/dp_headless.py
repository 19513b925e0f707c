"""Data-parallel replicas on other nodes, the headless node's side (`kvrelay serve
--headless`, or a Ray actor of `engine/dp_ray.py`): start this node's replicas, join the
head (`engine/dp_link.py`: Hello, then Welcome or Reject) and relay between the head's
link and each replica's engine-core pipe.

Failure: a headless node that loses the head stops its replicas and exits 1. Shutdown:
the head sends Shutdown to each of its replicas; the node stops its replicas and exits 0
when all have exited.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from types import FrameType
from typing import Any

from kvrelay import envs
from kvrelay.config import EngineArgs
from kvrelay.engine.codec import FROM_ENGINE, CodecError, MessagePipe
from kvrelay.engine.core_proc import run_engine_core
from kvrelay.engine.dp_link import (
    VERSION,
    encode,
    handshake,
    layout_of,
    recv_message,
    send_message,
    to_node,
)
from kvrelay.engine.dp_placement import replica_args
from kvrelay.engine.messages import Fatal, FromEngine, Hello, Reject, Shutdown, Welcome
from kvrelay.framing import FrameError

logger = logging.getLogger(__name__)

Cores = dict[int, tuple[Any, MessagePipe[FromEngine]]]   # rank → (process, its pipe)


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
    send_message(sock, encode(Hello(VERSION, layout_of(args), args.data_parallel_start_rank,
                                        args.local_replicas)))
    answer = handshake(recv_message(sock))
    if not isinstance(answer, Welcome):
        sock.close()
        why = answer.error if isinstance(answer, Reject) else f"answered {answer.tag!r}"
        raise ValueError(f"the data-parallel head refused this node: {why}")
    sock.settimeout(None)
    args = replace(args, data_parallel_master_port=answer.master_port)
    start = args.data_parallel_start_rank
    ranks = range(start, start + args.local_replicas)
    ctx = mp.get_context("spawn")
    cores: Cores = {}
    for r in ranks:
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=run_engine_core,
                        args=(replica_args(args, r), theirs, logging.getLogger().level),
                        name=f"kvrelay-engine-core-dp{r}", daemon=False)
        p.start()
        cores[r] = (p, MessagePipe(mine, FROM_ENGINE))
    logger.info("headless: data-parallel ranks %s joined the head at %s:%d", list(ranks),
                args.data_parallel_address, args.data_parallel_rpc_port)
    return _relay(sock, cores, signals)


def _relay(sock: socket.socket, cores: Cores, signals: bool = True) -> int:
    return _Relay(sock, cores).run(signals)


class _Relay:
    """The head's link ↔ this node's engine-core pipes: one pump thread per replica carries
    its messages to the head, the calling thread carries the head's to the replicas. Owns
    the send lock (the pumps share the head's socket), `stopping` and `shut` (the replicas
    the head told to shut down)."""

    def __init__(self, sock: socket.socket, cores: Cores) -> None:
        self.sock = sock
        self.cores = cores
        self.send_lock = threading.Lock()
        self.stopping = threading.Event()
        self.shut: set[int] = set()

    def run(self, signals: bool) -> int:
        """Relay until every replica is told to shut down (0) or the head is lost (1); then
        stop the replicas and close the link."""
        for rank, (_, conn) in self.cores.items():
            threading.Thread(target=self._pump, args=(rank, conn), daemon=True).start()
        if signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        rc = 0
        try:
            self._from_head()
        except (OSError, ValueError) as e:
            if not self.stopping.is_set():
                logger.error("lost the data-parallel head: %s; stopping this node's replicas", e)
                rc = 1
        self.stopping.set()
        _stop_cores(self.cores)
        self.sock.close()
        return rc

    def _pump(self, rank: int, conn: MessagePipe[FromEngine]) -> None:   # engine core → head
        while True:
            message = self._next_from_core(rank, conn)
            if message is None:
                return
            try:
                with self.send_lock:
                    send_message(self.sock, encode(message, rank))
            except OSError:
                return
            if isinstance(message, Fatal):
                return

    def _next_from_core(self, rank: int, conn: MessagePipe[FromEngine]) -> FromEngine | None:
        """The replica's next message; Fatal when its process is gone unexpectedly, None when
        it is gone because it was told to stop."""
        try:
            return conn.recv()
        except (EOFError, OSError, CodecError) as e:
            if self.stopping.is_set() or rank in self.shut:
                return None
            why = f": {e}" if isinstance(e, CodecError) else ""
            return Fatal(f"the engine process of data-parallel replica {rank} exited{why}")

    def _from_head(self) -> None:
        """Head → engine cores, until every replica is told to shut down. OSError or
        ValueError (CodecError, FrameError): the link is lost or broken."""
        while len(self.shut) < len(self.cores):
            target, message = to_node(recv_message(self.sock))    # CodecError: a ValueError
            if target not in self.cores:
                raise FrameError(f"message for replica {target!r}, which this node does not "
                                 f"run")
            if isinstance(message, Shutdown):
                self.shut.add(target)
            try:
                self.cores[target][1].send(message)
            except OSError:
                pass

    def _on_signal(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopping.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _stop_cores(cores: Cores) -> None:
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
