"""The KV side channel: a small request/response service on the prefill server's
`VLLM_NIXL_SIDE_CHANNEL_HOST:PORT` where decode servers fetch transport metadata.

Wire format: each message is one frame of `kvrelay/framing.py` (a 4-byte big-endian
length, then UTF-8 JSON encoding an object). Frames over the limit (requests to the
server: 64 KiB; replies: 16 MiB; the authentication exchange: 4 KiB) or that are not a
JSON object are rejected with an error reply; an oversized frame also closes the
connection (its body is never read). With a KV secret, a connection authenticates before
its first request (`kvrelay.disagg.auth`).

A request is any JSON object; the server answers `{"ok": true, "result": {...}}` with
what the handler returned, or `{"ok": false, "error": "..."}` when the request was
malformed or the handler raised (`SideChannelError` messages are passed verbatim, so a
handler can refuse a peer with a clear reason). `side_channel_call` returns the result
or raises `SideChannelError` (`SideChannelRefused` when the server answered with an error).
"""
from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from kvrelay import envs
from kvrelay.disagg.auth import AuthError, client_authenticate
from kvrelay.disagg.framed_server import FramedServer
from kvrelay.framing import (
    MAX_FRAME,
    FrameError,
    encode_frame,
    recv_frame,
    send_frame,  # noqa: F401  (re-exported: callers import the framing from here)
)

logger = logging.getLogger(__name__)

ADVERTISE_HOST_ENV = envs.SIDE_CHANNEL_ADVERTISE_HOST.name
_ENV_HINT = "VLLM_NIXL_SIDE_CHANNEL_HOST/VLLM_NIXL_SIDE_CHANNEL_PORT"


class SideChannelError(RuntimeError):
    """A side-channel call failed; the message names the address and the reason."""


class SideChannelRefused(SideChannelError):
    """The server answered the request with an error (`{"ok": false, "error": reason}`);
    `reason` is the server's error string, verbatim."""

    def __init__(self, message: str, reason: object) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------
# addresses


def advertised_host(bind_host: str) -> str:
    """The address peers should dial for a listener bound to `bind_host`.

    `KVRELAY_SIDE_CHANNEL_ADVERTISE_HOST` wins when set. A wildcard bind (0.0.0.0, ::,
    empty) advertises the IP of the interface that carries the default route (found by
    `connect`ing a UDP socket to a documentation address: no packet is sent); without a
    default route (a private network, e.g. hosts joined by one veth or a cluster fabric)
    the first non-loopback IPv4 address of an interface that is up; else 127.0.0.1.
    Any other bind address is advertised as is.
    """
    env = (envs.SIDE_CHANNEL_ADVERTISE_HOST.raw() or "").strip()
    if env:
        return env
    if bind_host not in ("0.0.0.0", "::", "", "*", "[::]"):
        return bind_host
    probes = [(socket.AF_INET, ("192.0.2.1", 9))]
    if bind_host in ("::", "[::]"):
        probes.insert(0, (socket.AF_INET6, ("2001:db8::1", 9)))
    for family, target in probes:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                ip = s.getsockname()[0]
        except OSError:
            continue
        if ip and ip not in ("0.0.0.0", "::"):
            return ip
    addresses = interface_addresses()
    return addresses[0][1] if addresses else "127.0.0.1"


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface that is up, loopback excluded, in
    interface-index order (Linux ioctls; empty elsewhere)."""
    try:
        import fcntl
    except ImportError:
        return []
    siocgifflags, siocgifaddr, iff_up, iff_loopback = 0x8913, 0x8915, 0x1, 0x8
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), siocgifflags, req)[16:18])[0]
                if not flags & iff_up or flags & iff_loopback:
                    continue
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:                      # no IPv4 address on this interface
                continue
            out.append((name, addr))
    return out


# ---------------------------------------------------------------------------------------
# server


REQUEST_MAX_FRAME = 64 * 1024     # a request to a side channel is < 2 KiB; replies may be larger


class SideChannelServer:
    """Serves `handler(request) -> reply` on host:port, a thread per connection (at most
    `max_connections`), many requests per connection. `port=0` picks a free port (see
    `.address`).

    The listener is a `FramedServer`: with a `secret` every connection first runs the
    mutual challenge–response of `kvrelay.disagg.auth` (small frames, a few seconds); a peer
    that fails it is told "authentication failed" and disconnected before any request is
    read. When the connection limit is reached a new connection evicts the oldest one that
    has not authenticated yet (so a flood of idle connections cannot lock honest peers out);
    without such a connection it is refused. Requests are at most `max_frame` bytes and
    a connection idle for `idle_timeout` seconds is closed. With a secret the server proves
    itself as `identity` for its advertised address (`advertised_address`, computed once
    at construction) and refuses peers that dialed another one."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict], *,
                 max_frame: int = REQUEST_MAX_FRAME, idle_timeout: float = 60.0,
                 max_connections: int = 256, name: str = "kv-side-channel",
                 secret: bytes | None = None, identity: str = "") -> None:
        self.handler = handler
        self._listener = FramedServer(host, port, self._serve, label="side channel", name=name,
                                      secret=secret, max_connections=max_connections,
                                      idle_timeout=idle_timeout, max_frame=max_frame,
                                      advertise_host=advertised_host(host), identity=identity)

    def start(self) -> SideChannelServer:
        try:
            self._listener.start()
        except OSError as e:
            where = f"{self._listener.host}:{self._listener.port}"
            raise SideChannelError(f"KV side channel cannot listen on {where} "
                                   f"({e.strerror or e}); set {_ENV_HINT} to a free address") from e
        return self

    @property
    def address(self) -> tuple[str, int]:
        """(bind host, bound port)."""
        return self._listener.host, self._listener.port

    @property
    def advertised_address(self) -> tuple[str, int]:
        """(host peers should dial, port): the endpoint this server proves itself for."""
        return self._listener.endpoint

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        for msg in self._listener.requests(conn, peer):
            reply = self._dispatch(msg)
            try:
                frame = encode_frame(reply, MAX_FRAME)
            except (FrameError, TypeError, ValueError) as e:
                frame = encode_frame({"ok": False, "error": f"reply could not be sent: {e}"})
            conn.sendall(frame)

    def _dispatch(self, msg: dict) -> dict:
        try:
            result = self.handler(msg)
        except SideChannelError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:
            logger.exception("side channel handler failed on %s", str(msg)[:200])
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if not isinstance(result, dict):
            return {"ok": False, "error": f"handler returned {type(result).__name__}, not a dict"}
        return {"ok": True, "result": result}

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> SideChannelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# client


def _connect_error(host: str, port: int, e: BaseException, timeout: float) -> SideChannelError:
    where = f"KV side channel {host}:{port}"
    if isinstance(e, ConnectionRefusedError):
        why = ("connection refused: nothing listens there. Check that the prefill server is up "
               f"and that {_ENV_HINT} (on the prefill server) and the remote_host/remote_port it "
               "advertises point at it")
    elif isinstance(e, socket.gaierror):
        why = f"cannot resolve host {host!r} ({e}); check {_ENV_HINT}"
    elif isinstance(e, TimeoutError):
        why = f"no answer within {timeout:g}s (host unreachable or firewalled?); check {_ENV_HINT}"
    else:
        why = f"{type(e).__name__}: {e}; check {_ENV_HINT}"
    return SideChannelError(f"{where}: {why}")


class SideChannelClient:
    """A connection to a side channel, for several calls. With a `secret` the connection
    authenticates first (SideChannelError "... authentication failed" otherwise): this
    client as `identity`, the server for exactly (host, port) as dialed here and, when
    `expect_id` is given, as that identity."""

    def __init__(self, host: str, port: int, timeout: float = 10.0,
                 max_frame: int = MAX_FRAME, secret: bytes | None = None,
                 identity: str = "", expect_id: str | None = None) -> None:
        self.host, self.port, self.timeout, self.max_frame = host, int(port), timeout, max_frame
        try:
            self._sock = socket.create_connection((host, self.port), timeout=timeout)
        except OSError as e:
            raise _connect_error(host, self.port, e, timeout) from e
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if secret is not None:
            try:
                client_authenticate(self._sock, secret, endpoint=(host, self.port),
                                    identity=identity, expect_id=expect_id)
            except AuthError as e:
                self.close()
                raise SideChannelError(f"KV side channel {host}:{self.port}: {e} (is "
                                       f"KVRELAY_KV_SECRET the same on every server?)") from None
            self._sock.settimeout(timeout)

    def call(self, message: dict) -> dict:
        where = f"KV side channel {self.host}:{self.port}"
        try:
            self._sock.sendall(encode_frame(message, self.max_frame))
            reply = recv_frame(self._sock, self.max_frame)
        except FrameError as e:
            raise SideChannelError(f"{where}: bad reply: {e}") from e
        except TimeoutError as e:
            raise SideChannelError(f"{where}: no reply within {self.timeout:g}s") from e
        except OSError as e:
            raise SideChannelError(f"{where}: connection failed ({type(e).__name__}: {e})") from e
        if reply is None:
            raise SideChannelError(f"{where}: the server closed the connection without a reply")
        if reply.get("ok") is True and isinstance(reply.get("result"), dict):
            return reply["result"]
        if reply.get("ok") is False:
            raise SideChannelRefused(f"{where} answered with an error: {reply.get('error')}",
                                     reply.get("error"))
        raise SideChannelError(f"{where}: malformed reply (keys {sorted(reply)[:5]})")

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def side_channel_call(host: str, port: int, message: dict, timeout: float = 10.0,
                      secret: bytes | None = None, identity: str = "",
                      expect_id: str | None = None) -> dict:
    """One request on a fresh connection; the handler's reply, or SideChannelError
    (`SideChannelRefused`: the server refused the request)."""
    with SideChannelClient(host, port, timeout, secret=secret, identity=identity,
                           expect_id=expect_id) as client:
        return client.call(message)
