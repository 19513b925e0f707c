"""Data-parallel replicas on other nodes, the head's side: the listener and the replicas
it reaches through a connected headless node (`engine/dp_headless.py` is the node's side).

    head (kvrelay serve -dp N -dpl L --data-parallel-rpc-port P)
        API server, replicas [0, L), HeadListener on address:P
    headless node (kvrelay serve -dp N -dpl L' --data-parallel-start-rank S --headless
                   --data-parallel-address HEAD --data-parallel-rpc-port P)
        replicas [S, S + L'), no API server; connects to the head and relays

The wire (frames, handshake, layout check) is `engine/dp_link.py`: the node opens with
Hello, the head answers Welcome or Reject (the node exits 1 with that message; the head
logs it and keeps waiting); after that both directions carry the engine-core messages,
each with its replica's rank.

Failure: a head that loses a headless node fails that node's replicas (the server then
stops, as for any dead replica). Shutdown: the head sends Shutdown to each remote replica.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from kvrelay.config import EngineArgs
from kvrelay.engine.client import EngineDeadError
from kvrelay.engine.core_client import CoreClient
from kvrelay.engine.dp_link import (
    check_hello,
    encode,
    from_node,
    handshake,
    layout_of,
    recv_message,
    send_message,
)
from kvrelay.engine.messages import Fatal, Reject, Shutdown, ToEngine, Welcome

logger = logging.getLogger(__name__)


class RemoteNode:
    """One connected headless node: the socket, a send lock, a reader thread."""

    def __init__(self, sock: socket.socket, replicas: dict[int, RemoteReplica]) -> None:
        self.sock, self.replicas = sock, replicas
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._reader, name="kvrelay-dp-node", daemon=True).start()

    def send(self, body: bytes) -> None:
        if self.closed:
            raise ConnectionError("the headless node is gone")
        with self.lock:
            send_message(self.sock, body)

    def _reader(self) -> None:
        why = "the headless node closed the connection"
        try:
            while True:
                rank, message = from_node(recv_message(self.sock))   # CodecError: a ValueError
                replica = self.replicas.get(rank)
                if replica is not None:
                    replica.receive(message)
        except (OSError, ValueError) as e:
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
            hello = handshake(recv_message(conn))
            ranks = check_hello(hello, self.layout, self.claimed, self.args.local_replicas)
        except (OSError, ValueError) as e:
            logger.error("refused a headless node at %s:%d: %s", peer[0], peer[1], e)
            try:
                send_message(conn, encode(Reject(str(e))))
            except OSError:
                pass
            conn.close()
            return
        self.claimed |= set(ranks)
        send_message(conn, encode(Welcome(self.args.data_parallel_master_port)))
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
