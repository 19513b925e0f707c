"""Authentication of the KV plane: a shared secret per topology, a mutual challenge–response
that binds who is speaking, and the MAC on the `kv_transfer_params` a prefill hands out.

The secret comes from `KVRELAY_KV_SECRET` or from the file named by
`kv_connector_extra_config.secret_file` (the environment wins). With a secret, every KV
listener (the side channel, the TCP transport) runs this exchange on a new connection
before it reads any other frame, so a peer without the secret learns nothing but
"authentication failed" (protocol version 2):

    client → {"auth": "hello", "v": 2, "nonce": Nc, "endpoint": [host, port], "id": C}
               (endpoint: exactly what the client dialed; C: its identity, e.g. engine id/role)
    server   refuses unless `endpoint` is its own advertised endpoint
    server → {"ok": true, "nonce": Ns, "endpoint": [host, port], "id": S,
              "proof": HMAC(K_server, "proof\\0" | T)}
    client   checks the proof over T built with the endpoint IT DIALED (and the server id
             it expects, when it knows one): a proof made for another endpoint fails
    client → {"auth": "proof", "proof": HMAC(K_client, "proof\\0" | T)}
    server → {"ok": true}      or {"ok": false, "error": "authentication failed"}, then close

    T = canonical JSON ["kvrelay-kv-auth", 2, Nc, Ns, C, client's endpoint, S, server's endpoint]

Keys are role-separated: K = SHA-256("kvrelay-kv-secret\\0" | secret), K_role =
HMAC(K, "kvrelay/2 " | role) for role in server, client, params. So a server's proof is
never a valid client proof (no reflection), a proof covers both nonces (no replay on
another connection) and both identities and the endpoint (no relay: a man in the middle
at address A that forwards a client's hello to the real server at B gets a proof for B,
which the client, having dialed A, refuses; the server refuses the hello naming A first).
The secret itself never crosses the wire; proofs and MACs are compared in constant time.
Every frame of the exchange is at most `PREAUTH_MAX_FRAME` bytes and the whole exchange
must finish within `AUTH_TIMEOUT_S`.

`params_mac` is the prefill's MAC over the kv_transfer_params it returns (see
`kvrelay/disagg/params.py`): a decode with the secret dials only what a prefill signed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrelay import envs
from kvrelay.disagg.params import KVParamsError
from kvrelay.framing import FrameError, recv_frame, send_frame

logger = logging.getLogger(__name__)

PREAUTH_MAX_FRAME = 4096  # bytes: the auth frames are ~400 bytes
AUTH_TIMEOUT_S = 5.0  # the whole exchange, however slowly bytes trickle in
AUTH_FAILED = "authentication failed"
VERSION = 2  # 2: role-separated keys; endpoints and identities under the proofs
_NONCE_BYTES = 32
MAX_IDENTITY = 256  # characters of an identity or a host in the hello
PARAMS_MAC_KEY = "remote_mac"  # kvrelay's extra key in kv_transfer_params
# addresses a listener may bind but a peer cannot dial (kvrelay proxy substitutes them)
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})

Endpoint = tuple[str, int]  # (host, port) as dialed / as advertised


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


def _role_key(secret: bytes, role: str) -> bytes:
    """K_role = HMAC(K, "kvrelay/2 " | role): one key per role, so a MAC made for one
    purpose is never valid for another."""
    return hmac.new(_key(secret), f"kvrelay/{VERSION} {role}".encode(), hashlib.sha256).digest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _transcript(nc: bytes, ns: bytes, client_id: str, client_dialed: Endpoint,
                server_id: str, server_endpoint: Endpoint) -> bytes:
    return _canonical(["kvrelay-kv-auth", VERSION, _b64(nc), _b64(ns),
                       client_id, [client_dialed[0], client_dialed[1]],
                       server_id, [server_endpoint[0], server_endpoint[1]]])


def _proof(secret: bytes, role: str, transcript: bytes) -> str:
    return _b64(hmac.new(_role_key(secret, role), b"proof\0" + transcript,
                         hashlib.sha256).digest())


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


def _endpoint(value: Any) -> Endpoint:
    """A [host, port] pair from the wire; AuthError when it is not one."""
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and 0 < len(value[0]) <= MAX_IDENTITY and type(value[1]) is int
            and 0 < value[1] < 65536):
        return value[0], value[1]
    raise AuthError(AUTH_FAILED)


def _identity(value: Any) -> str:
    if isinstance(value, str) and len(value) <= MAX_IDENTITY:
        return value
    raise AuthError(AUTH_FAILED)


def endpoint_str(endpoint: Endpoint) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def client_authenticate(sock: socket.socket, secret: bytes, *, endpoint: Endpoint,
                        identity: str = "", expect_id: str | None = None,
                        max_frame: int = PREAUTH_MAX_FRAME) -> None:
    """Run the client's half on a fresh connection; AuthError unless both sides proved K.

    `endpoint` is (host, port) exactly as this client dialed it: a server proving for any
    other endpoint (a relay) is refused. `identity` names this client (engine id / role);
    `expect_id`, when given, is the server identity this client expects."""
    deadline = time.monotonic() + AUTH_TIMEOUT_S
    dialed = (str(endpoint[0]), int(endpoint[1]))
    nc = secrets.token_bytes(_NONCE_BYTES)
    try:
        send_frame(sock, {"auth": "hello", "v": VERSION, "nonce": _b64(nc),
                          "endpoint": list(dialed), "id": identity})
        reply = recv_frame(sock, max_frame, deadline=deadline)
        if not reply or reply.get("ok") is not True:
            raise AuthError(AUTH_FAILED)
        ns, server_id = _nonce(reply.get("nonce")), _identity(reply.get("id"))
        claimed = reply.get("endpoint")
        if claimed != list(dialed):
            raise AuthError(f"{AUTH_FAILED} (the server proved for endpoint {claimed!r}, this "
                            f"client dialed {endpoint_str(dialed)}: a relay?)")
        if expect_id is not None and server_id != expect_id:
            raise AuthError(f"{AUTH_FAILED} (the server is {server_id[:100]!r}, expected "
                            f"{expect_id[:100]!r})")
        transcript = _transcript(nc, ns, identity, dialed, server_id, dialed)
        if not _same(reply.get("proof"), _proof(secret, "server", transcript)):
            raise AuthError(f"{AUTH_FAILED} (the server's proof does not match this KV secret)")
        send_frame(sock, {"auth": "proof", "proof": _proof(secret, "client", transcript)})
        reply = recv_frame(sock, max_frame, deadline=deadline)
    except (FrameError, OSError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"{AUTH_FAILED} ({type(e).__name__}: {e})") from None
    if not reply or reply.get("ok") is not True:
        raise AuthError(AUTH_FAILED)


def server_authenticate(sock: socket.socket, secret: bytes, *, endpoint: Endpoint,
                        identity: str = "") -> str:
    """Run the server's half as `identity` listening at its advertised `endpoint`; the
    authenticated client's identity. On failure the peer has been told AUTH_FAILED (best
    effort) and AuthError is raised with the reason for the log (the caller closes)."""
    deadline = time.monotonic() + AUTH_TIMEOUT_S
    own = (str(endpoint[0]), int(endpoint[1]))
    try:
        hello = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
        if hello is None:
            raise AuthError("closed before authenticating")
        if hello.get("auth") != "hello":
            raise AuthError(AUTH_FAILED)
        if hello.get("v") != VERSION:
            raise AuthError(f"{AUTH_FAILED} (protocol version {str(hello.get('v'))[:20]}, "
                            f"this server speaks {VERSION}: upgrade every server)")
        nc, client_id = _nonce(hello.get("nonce")), _identity(hello.get("id"))
        dialed = _endpoint(hello.get("endpoint"))
        if dialed != own:
            raise AuthError(f"{AUTH_FAILED} (the client dialed {endpoint_str(dialed)[:300]}, "
                            f"this listener is {endpoint_str(own)}: a relay?)")
        ns = secrets.token_bytes(_NONCE_BYTES)
        transcript = _transcript(nc, ns, client_id, dialed, identity, own)
        send_frame(sock, {"ok": True, "nonce": _b64(ns), "endpoint": list(own), "id": identity,
                          "proof": _proof(secret, "server", transcript)})
        answer = recv_frame(sock, PREAUTH_MAX_FRAME, deadline=deadline)
        if (not answer or answer.get("auth") != "proof"
                or not _same(answer.get("proof"), _proof(secret, "client", transcript))):
            raise AuthError(AUTH_FAILED)
        send_frame(sock, {"ok": True})
        return client_id
    except (AuthError, FrameError, OSError) as e:
        try:
            send_frame(sock, {"ok": False, "error": AUTH_FAILED})
        except OSError:
            pass
        raise AuthError(str(e) if isinstance(e, AuthError) else AUTH_FAILED) from None


# -- the MAC on kv_transfer_params ---------------------------------------------------------


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    """SHA-256 of the prompt's token ids (8 bytes each, big-endian): what the params MAC
    binds, so a prefill's KV can be loaded only for the prompt it was computed for."""
    return hashlib.sha256(struct.pack(f">{len(prompt_ids)}Q", *prompt_ids)).hexdigest()


def params_mac(secret: bytes, *, remote_engine_id: Any, remote_host: Any, remote_port: Any,
               remote_request_id: Any, tp_size: Any, remote_capability: Any,
               remote_block_ids: Any, prompt_ids: Sequence[int]) -> str:
    """The prefill's MAC over the kv_transfer_params it hands out (key K_params), bound to
    the prompt it computed the KV for. Values are encoded as given (canonical JSON, types
    included), so any change of a field, of a field's type or of the prompt changes it."""
    message = _canonical(["kvrelay-kv-params", VERSION, remote_engine_id, remote_host,
                          remote_port, remote_request_id, tp_size, remote_capability,
                          remote_block_ids, prompt_digest(prompt_ids)])
    mac = hmac.new(_role_key(secret, "params"), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode("ascii").rstrip("=")


def params_mac_matches(given: Any, expected: str) -> bool:
    """Constant-time comparison of a presented `remote_mac` with the expected one."""
    return _same(given, expected)


def check_params(params: Any, prompt_ids: Sequence[int], secret: bytes | None,
                 allowed: frozenset[tuple[str, int]] | None) -> None:
    """A decode's check of do_remote_prefill params (`KVConnector.verify_params`):
    KVParamsError unless their side channel is in `allowed` (when given) and, with a
    secret, `remote_mac` is the MAC over exactly these params and this prompt."""
    host, port = params.remote_host, params.remote_port
    if allowed is not None and (host, port) not in allowed:
        raise KVParamsError(
            f"kv_transfer_params.remote_host/remote_port {endpoint_str((host, port))[:300]} "
            f"is not a prefill this decode server may load from (kv_connector_extra_config."
            f"allowed_prefills)")
    if secret is None:
        return
    if params.remote_mac is None:
        raise KVParamsError(
            "kv_transfer_params.remote_mac is missing: this decode server has a KV secret "
            "and loads KV only with the kv_transfer_params a prefill server of its "
            "topology returned, unchanged")
    expected = params_mac(
        secret, remote_engine_id=params.remote_engine_id, remote_host=host,
        remote_port=port, remote_request_id=params.remote_request_id,
        tp_size=params.tp_size, remote_capability=params.remote_capability,
        remote_block_ids=params.remote_block_ids, prompt_ids=prompt_ids)
    if not params_mac_matches(params.remote_mac, expected):
        raise KVParamsError(
            "kv_transfer_params.remote_mac does not match: the kv_transfer_params were "
            "changed after the prefill server returned them, belong to another prompt, or "
            "come from a server without this topology's KV secret")
    if host.strip() in WILDCARD_HOSTS:    # never signed by a kvrelay prefill with a secret
        raise KVParamsError(f"kv_transfer_params.remote_host {host!r} cannot be dialed")


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
