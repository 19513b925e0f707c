"""The framed-TCP listener under both KV-plane servers (the side channel and the TCP
transport): the listening socket, its accept thread, a thread per connection, the
connection cap, the KV secret's handshake (`kvrelay.disagg.auth`) and an orderly close.
What a request means stays with the owner, whose `serve(conn, peer)` reads the requests
with `FramedServer.requests` (frames of `kvrelay/framing.py`).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvrelay.disagg.auth import AuthError, server_authenticate
from kvrelay.framing import FrameError, OversizedFrame, recv_frame, send_frame

logger = logging.getLogger(__name__)


@dataclass
class _Conn:
    thread: threading.Thread
    opened: float
    authenticated: bool = False
    evicted: bool = False
    peer_id: str = ""               # the identity the peer authenticated as


class FramedServer:
    """Owns the listening socket, the accept thread and the served connections (`_conns`,
    under `_lock`). A connection gets a thread of its own that sets TCP_NODELAY, runs the
    mutual challenge–response when there is a `secret` (a peer that fails it is told
    "authentication failed" and disconnected before any request is read), sets
    `idle_timeout` and calls `serve(conn, peer)`; an OSError out of `serve` ends the
    connection quietly, and the connection is closed when `serve` returns.

    At `max_connections` a new connection evicts the oldest one that has not authenticated
    yet (so a flood of idle connections cannot lock honest peers out); without such a
    connection it is refused. Logs name the server as "<label> host:port"; threads are
    "<name>-accept" and "<name>-conn", daemons all.

    With a secret the server proves itself as `identity` at its advertised endpoint
    (`advertise_host` or `host`, and the bound port: `endpoint`), and refuses clients
    that dialed any other endpoint (`kvrelay.disagg.auth`)."""

    def __init__(self, host: str, port: int, serve: Callable[[socket.socket, Any], None], *,
                 label: str, name: str, secret: bytes | None, max_connections: int,
                 idle_timeout: float, max_frame: int, advertise_host: str | None = None,
                 identity: str = "") -> None:
        self.host, self.port = host, int(port)
        self.advertise_host = advertise_host or host
        self.identity = identity
        self.serve = serve
        self.label, self.name = label, name
        self.secret = secret
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._conns: dict[socket.socket, _Conn] = {}
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"{self.label} {self.host}:{self.port}"

    @property
    def endpoint(self) -> tuple[str, int]:
        """(host, port) peers dial: the advertised host and the bound port."""
        return self.advertise_host, self.port

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Listen and accept (once; later calls do nothing). OSError when host:port cannot
        be bound; `port` 0 becomes the bound port."""
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.2)            # how often the accept loop looks at the stop flag
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, args=(sock,),
                                               name=f"{self.name}-accept", daemon=True)
        self._accept_thread.start()
        logger.debug("%s listening on %s:%d", self.label, self.host, self.port)

    def _accept_loop(self, sock: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = sock.accept()
            except OSError:             # a timeout, or close() closed the socket
                continue
            with self._lock:
                if self._stop.is_set() or not self._admit(peer):
                    conn.close()
                    continue
                t = threading.Thread(target=self._run, args=(conn, peer), daemon=True,
                                     name=f"{self.name}-conn")
                self._conns[conn] = _Conn(t, time.monotonic())
            t.start()

    def _admit(self, peer: Any) -> bool:
        """Under the lock: may a new connection be served? At the limit, evict the oldest
        connection that has not authenticated yet — its thread sees EOF and exits — else
        refuse."""
        if len(self._conns) < self.max_connections:
            return True
        pending = [(c.opened, s) for s, c in self._conns.items()
                   if not (c.authenticated or c.evicted)]
        if self.secret is not None and pending:
            _, oldest = min(pending, key=lambda x: x[0])
            _shutdown(oldest)
            self._conns[oldest].evicted = True
            logger.debug("%s: connection limit %d reached, evicted an unauthenticated one",
                         self.where, self.max_connections)
            return True
        warn_limited(f"{self.where}: refusing %s, %d connections open (the limit)", peer,
                     len(self._conns))
        return False

    def _run(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.secret is None or self._authenticate(conn, peer):
                conn.settimeout(self.idle_timeout)
                self.serve(conn, peer)
        except OSError:
            pass                        # the peer went away, or close() shut the connection
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass

    def _authenticate(self, conn: socket.socket, peer: Any) -> bool:
        """The server's half of the challenge–response; on success the connection counts
        as authenticated (so it is never evicted as a pending one) unless it was evicted
        meanwhile."""
        assert self.secret is not None
        try:
            peer_id = server_authenticate(conn, self.secret, endpoint=self.endpoint,
                                          identity=self.identity)
        except AuthError as e:
            warn_limited(f"{self.where}: refused %s: %s", peer, e)
            return False
        with self._lock:
            state = self._conns.get(conn)
            if state is None or state.evicted:
                return False
            state.authenticated, state.peer_id = True, peer_id
        logger.debug("%s: %s authenticated as %.100r", self.where, peer, peer_id)
        return True

    def requests(self, conn: socket.socket, peer: Any) -> Iterator[dict]:
        """The requests on `conn` until the peer closes it or the server stops. A frame
        over `max_frame` or not a JSON object gets an error reply; an oversized one also
        ends the connection (its body was not read: the stream cannot continue)."""
        while not self._stop.is_set():
            try:
                msg = recv_frame(conn, self.max_frame)
            except FrameError as e:
                warn_limited(f"{self.label}: bad frame from %s: %s", peer, e)
                send_frame(conn, {"ok": False, "error": str(e)})
                if isinstance(e, OversizedFrame):
                    return
                continue
            if msg is None:
                return
            yield msg

    def stop(self) -> None:
        """Accept nothing more and end each connection after its current request (close()
        does this first; an owner calls it early to stop serving while it winds down)."""
        self._stop.set()

    def close(self) -> None:
        """Stop, close the listener, shut every connection down and join the threads (5 s
        each at most). Idempotent."""
        self.stop()
        if self._sock is not None:
            _shutdown(self._sock)       # wakes a blocked accept()
            try:
                self._sock.close()
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            _shutdown(conn)
        for _, c in conns:
            c.thread.join(timeout=5)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_last_logged: dict[str, float] = {}


def warn_limited(fmt: str, *args: Any) -> None:
    """A WARNING at most once a minute per message format: a flood of bad peers must not
    flood the log."""
    now = time.monotonic()
    if now - _last_logged.get(fmt, -60.0) < 60.0:
        return
    _last_logged[fmt] = now
    # the caller's format stays lazy: only a constant suffix is added to it
    logger.warning(fmt + " (repeats of this warning are suppressed for a minute)",  # noqa: G003
                   *args)
