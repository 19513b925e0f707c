"""Authentication of the KV plane: a shared secret per topology, a mutual challenge–response.

The secret comes from `KVRELAY_KV_SECRET` or from the file named by
`kv_connector_extra_config.secret_file` (the environment wins). With a secret, every KV
listener (the side channel, the TCP transport) runs this exchange on a new connection
before it reads any other frame, so a peer without the secret learns nothing but
"authentication failed":

    client → {"auth": "hello", "v": 1, "nonce": Nc}
    server → {"ok": true, "nonce": Ns, "proof": HMAC(K, "server" | Nc | Ns)}
    client   checks the server's proof (the server knows K too: mutual)
    client → {"auth": "proof", "proof": HMAC(K, "client" | Nc | Ns)}
    server → {"ok": true}      or {"ok": false, "error": "authentication failed"}, then close

Nc and Ns are 32 fresh random bytes (base64), so no proof can be replayed on another
connection; the role labels keep a server's proof from being reflected as a client's.
K is SHA-256 of the secret, and the secret itself never crosses the wire. Proofs are
compared in constant time. Every frame of the exchange is at most `PREAUTH_MAX_FRAME`
bytes and the whole exchange must finish within `AUTH_TIMEOUT_S`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from kvrelay import envs
from kvrelay.framing import FrameError, recv_frame, send_frame

logger = logging.getLogger(__name__)

PREAUTH_MAX_FRAME = 4096  # bytes: the auth frames are ~150 bytes
AUTH_TIMEOUT_S = 5.0  # the whole exchange, however slowly bytes trickle in
AUTH_FAILED = "authentication failed"
_VERSION = 1
_NONCE_BYTES = 32


class AuthError(ConnectionError):
    """The peer did not prove that it knows the KV secret (or the exchange broke off)."""


def load_secret(extra: dict[str, Any] | None = None) -> bytes | None:
    """The topology's KV secret: `KVRELAY_KV_SECRET`, else the file named by
    `kv_connector_extra_config.secret_file`, else None (no authentication)."""
    value = envs.KV_SECRET.raw()
    if value:
        return value.encode()
    path = (extra or {}).get("secret_file")
    if not path:
        return None
    try:
        text = Path(os.path.expanduser(str(path))).read_text().strip()
    except OSError as e:
        raise ValueError(
            f"--kv-transfer-config: cannot read kv_connector_extra_config.secret_file "
            f"{path!r}: {e.strerror or e}"
        ) from None
    if not text:
        raise ValueError(
            f"--kv-transfer-config: kv_connector_extra_config.secret_file {path!r} is empty"
        )
    return text.encode()


def _key(secret: bytes) -> bytes:
    return hashlib.sha256(b"kvrelay-kv-secret\0" + secret).digest()


def _proof(secret: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> str:
    mac = hmac.new(_key(secret), role + b"\0" + client_nonce + server_nonce, hashlib.sha256)
    return base64.b64encode(mac.digest()).decode("ascii")


def _nonce(value: Any) -> bytes:
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != _NONCE_BYTES:
        raise AuthError(AUTH_FAILED)
    return raw


def _same(a: Any, b: str) -> bool:
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


def client_authenticate(
    sock: socket.socket, secret: bytes, max_frame: int = PREAUTH_MAX_FRAME
) -> None:
    """Run the client's half on a fresh connection; AuthError unless both sides proved K."""
    deadline = time.monotonic() + AUTH_TIMEOUT_S
    nc = secrets.token_bytes(_NONCE_BYTES)
    try:
        send_frame(sock, {"auth": "hello", "v": _VERSION, "nonce": base64.b64encode(nc).decode()})
        reply = recv_frame(sock, max_frame, deadline=deadline)
        if not reply or reply.get("ok") is not True:
            raise AuthError(AUTH_FAILED)
        ns = _nonce(reply.get("nonce"))
        if not _same(reply.get("proof"), _proof(secret, b"server", nc, ns)):
            raise AuthError(f"{AUTH_FAILED} (the server's proof does not match this KV secret)")
        send_frame(sock, {"auth": "proof", "proof": _proof(secret, b"client", nc, ns)})
        reply = recv_frame(sock, max_frame, deadline=deadline)
    except (FrameError, OSError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"{AUTH_FAILED} ({type(e).__name__}: {e})") from None
    if not reply or reply.get("ok") is not True:
        raise AuthError(AUTH_FAILED)


def server_authenticate(sock: socket.socket, secret: bytes) -> None:
    """Run the server's half; on failure the peer has been told AUTH_FAILED (best effort)
    and AuthError is raised (the caller closes the connection)."""
    deadline = time.monotonic() + AUTH_TIMEOUT_S
    try:
        hello = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
        if hello is None:
            raise AuthError("closed before authenticating")
        if hello.get("auth") != "hello" or hello.get("v") != _VERSION:
            raise AuthError(AUTH_FAILED)
        nc, ns = _nonce(hello.get("nonce")), secrets.token_bytes(_NONCE_BYTES)
        send_frame(
            sock,
            {
                "ok": True,
                "nonce": base64.b64encode(ns).decode(),
                "proof": _proof(secret, b"server", nc, ns),
            },
        )
        answer = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
        if (
            not answer
            or answer.get("auth") != "proof"
            or not _same(answer.get("proof"), _proof(secret, b"client", nc, ns))
        ):
            raise AuthError(AUTH_FAILED)
        send_frame(sock, {"ok": True})
    except (AuthError, FrameError, OSError) as e:
        try:
            send_frame(sock, {"ok": False, "error": AUTH_FAILED})
        except OSError:
            pass
        raise AuthError(str(e) if isinstance(e, AuthError) else AUTH_FAILED) from None


_warned: set[str] = set()


def warn_if_exposed(host: str, secret: bytes | None, what: str) -> None:
    """One WARNING per process when a KV listener without a secret listens beyond loopback."""
    if secret is not None or is_loopback(host) or "exposed" in _warned:
        return
    _warned.add("exposed")
    logger.warning(
        "the KV plane (%s) listens on %s without authentication: anyone who can reach "
        "it can read this server's KV cache (other users' prompts) and free its blocks. "
        "Set %s to the same secret on every server of the topology (kvrelay deploy does), "
        "or keep the KV plane on a private network.",
        what,
        host,
        envs.KV_SECRET.name,
    )


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
