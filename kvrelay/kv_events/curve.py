"""CURVE for the KV-event sockets, keyed from the KV secret (`"auth": "kv_secret"`, kvrelay's).

The events carry the token ids of every cached prompt block. With `"auth": "kv_secret"` the
publisher's PUB and replay sockets are ZMQ CURVE servers and a subscriber must be a CURVE
client holding the client key; both keypairs are derived from the topology's KV secret
(the one the KV plane authenticates with, disagg/auth.py), so whoever has the secret — the
servers, `kvrelay proxy` — can follow the stream and nobody else can:

    K          = SHA-256("kvrelay-kv-secret\\0" | secret)                (disagg/auth.py)
    seed_role  = HMAC-SHA-256(K, "kvrelay/kv-events curve " | role)     role: server, client
    secret key = seed_role (a Curve25519 scalar), public key = curve_public(secret key)

The server knows the client's public key too and admits that one key only (a ZAP handler
in the publisher's ZMQ context), so knowing the server's public key is not enough: a
subscriber without the secret completes no handshake and receives nothing. Traffic is
encrypted. Role-separated seeds mean no key here is also a KV-plane key.

pyzmq is imported by the functions that need it (the publisher and subscriber already
have it loaded); `zmq.has("curve")` must hold (pyzmq's wheels build libzmq with it).
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any

from kvrelay.kv_events.config import FLAG, KVEventsConfig, read_secret

ZAP_DOMAIN = "kvrelay-kv-events"


@dataclass(frozen=True)
class CurveKeys:
    """Both keypairs, Z85-encoded (40 bytes each), as ZMQ's socket options take them."""
    server_public: bytes
    client_public: bytes
    server_secret: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)


def _seed(secret: bytes, role: str) -> bytes:
    key = hashlib.sha256(b"kvrelay-kv-secret\0" + secret).digest()     # disagg/auth.py's K
    return hmac.new(key, f"kvrelay/kv-events curve {role}".encode(), "sha256").digest()


def derive_keys(secret: bytes) -> CurveKeys:
    """The CURVE keypairs of a KV secret: the same secret, the same keys, on every host."""
    zmq = _curve_zmq()
    server_secret = zmq.utils.z85.encode(_seed(secret, "server"))
    client_secret = zmq.utils.z85.encode(_seed(secret, "client"))
    return CurveKeys(server_public=zmq.curve_public(server_secret),
                     client_public=zmq.curve_public(client_secret),
                     server_secret=server_secret, client_secret=client_secret)


def publisher_keys(config: KVEventsConfig) -> CurveKeys | None:
    """The keys a publisher with this config serves with (None: no auth)."""
    if config.auth is None:
        return None
    return derive_keys(read_secret(config.secret_file))


def make_server(sock: Any, keys: CurveKeys) -> None:
    """`sock` (PUB or ROUTER) becomes a CURVE server; its context needs an `Admitter`."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.zap_domain = ZAP_DOMAIN.encode()
    # no ZAP handler (its thread gone) must mean no connection, not "anyone" (libzmq's default)
    sock.setsockopt(_curve_zmq().ZAP_ENFORCE_DOMAIN, 1)


def make_client(sock: Any, keys: CurveKeys) -> None:
    """`sock` (SUB or DEALER) becomes a CURVE client of the derived server key."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class Admitter:
    """The publisher context's ZAP handler: admits the derived client key only (pyzmq's
    ThreadAuthenticator, one thread per context, with a key check as its callback)."""

    def __init__(self, context: Any, keys: CurveKeys) -> None:
        from zmq.auth.thread import ThreadAuthenticator
        self._client = keys.client_public
        self.refused = 0
        self._auth = ThreadAuthenticator(context, log=None)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self._client)
        self.refused += not ok
        return ok

    def stop(self) -> None:
        self._auth.stop()


def _curve_zmq() -> Any:
    import zmq
    import zmq.utils.z85
    if not zmq.has("curve"):
        raise ValueError(f'{FLAG}: "auth": "kv_secret" needs libzmq with CURVE; this pyzmq '
                         f"({zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}) has none")
    return zmq
