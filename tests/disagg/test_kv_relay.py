"""Issue 26: the KV secret cannot be relayed, and a decode never dials an address a client
chose. In-process: a socket man in the middle between an honest client and an honest
server (both ends refuse), reflection, old protocol versions, the prefill's MAC on the
kv_transfer_params it hands out (every field and the prompt bound), `allowed_prefills`,
and claims that are the client's mistake (ClaimRefused). The real-process attacks are in
tests/e2e/test_kv_security.py; docs/security.md names each claim's test."""

from __future__ import annotations

import base64
import dataclasses
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvrelay.disagg import auth
from kvrelay.disagg.auth import AUTH_FAILED, AuthError, client_authenticate, server_authenticate
from kvrelay.disagg.connector import ClaimRefused, HandshakeError, KVConnector
from kvrelay.disagg.params import KVParamsError, KVTransferConfig, KVTransferParams
from kvrelay.disagg.side_channel import (
    SideChannelError,
    SideChannelServer,
    recv_frame,
    send_frame,
    side_channel_call,
)
from kvrelay.disagg.tcp import TcpTransport
from kvrelay.disagg.transport import ReadDesc, TransferError
from kvrelay.kv_cache.manager import KVCacheGroup
from tests.disagg.test_kv_auth import NB, PROMPT, SECRET, SPEC

# -- helpers: an honest server thread, a relaying man in the middle ------------------------


@contextmanager
def honest_server(identity: str = "prefill-P") -> Iterator[tuple[tuple[str, int], queue.Queue]]:
    """A listener running the server's half once per connection as `identity` at its own
    address; each outcome (the client's identity, or the AuthError) goes to the queue."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    outcomes: queue.Queue = queue.Queue()
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                try:
                    outcomes.put(server_authenticate(conn, SECRET, endpoint=address,
                                                     identity=identity))
                except AuthError as e:
                    outcomes.put(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield address, outcomes
    finally:
        stop.set()
        t.join(5)
        listener.close()


Rewrite = Callable[[dict, tuple[str, int]], dict]   # (frame, the relay's address) → frame


@contextmanager
def relay(target: tuple[str, int], to_server: Rewrite | None = None,
          to_client: Rewrite | None = None) -> Iterator[tuple[tuple[str, int], list[int]]]:
    """A man in the middle without the secret: accepts connections and forwards each frame
    to `target` and back, optionally rewriting frames on the way. Yields its address and
    the number of connections it accepted so far (a one-item list)."""
    listener = socket.create_server(("127.0.0.1", 0))
    me = listener.getsockname()
    accepted = [0]
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, rewrite: Rewrite | None) -> None:
        try:
            while (msg := recv_frame(src)) is not None:
                send_frame(dst, rewrite(msg, me) if rewrite else msg)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            accepted[0] += 1
            upstream = socket.create_connection(target, timeout=5)
            for a, b, rw in ((client, upstream, to_server), (upstream, client, to_client)):
                threading.Thread(target=pump, args=(a, b, rw), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield me, accepted
    finally:
        stop.set()
        t.join(5)
        listener.close()


def naming(endpoint: tuple[str, int]) -> Rewrite:
    """The attacker's edit: a frame's "endpoint" replaced by `endpoint`."""
    return lambda msg, _: dict(msg, endpoint=list(endpoint)) if "endpoint" in msg else msg


def naming_itself(msg: dict, me: tuple[str, int]) -> dict:
    """The attacker's edit: a frame's "endpoint" replaced by the relay's own address."""
    return naming(me)(msg, me)


# -- the handshake binds the endpoint and the identities ------------------------------------


@pytest.mark.parametrize("edit", ["none", "hello", "hello-and-reply"])
def test_a_relaying_man_in_the_middle_fails_on_both_ends(monkeypatch, edit):
    """The attack of issue 26: the decode dials the attacker (A), who relays to the real
    prefill (B). Version 1 let the whole exchange through, and the attacker kept an
    authenticated session at B. Now the server refuses a hello naming A; an attacker that
    names B in the hello gets a proof for B, which the client (it dialed A) refuses; one
    that also names A in the reply breaks the proof."""
    monkeypatch.setattr(auth, "AUTH_TIMEOUT_S", 1.0)
    with honest_server() as (server_at, outcomes):
        to_server = naming(server_at) if edit != "none" else None
        to_client = naming_itself if edit == "hello-and-reply" else None
        with relay(server_at, to_server, to_client) as (attacker, accepted):
            with socket.create_connection(attacker, timeout=5) as s, \
                    pytest.raises(AuthError, match=AUTH_FAILED) as e:
                client_authenticate(s, SECRET, endpoint=attacker, identity="kv_consumer:D")
            got = outcomes.get(timeout=5)
            assert accepted[0] == 1
    assert isinstance(got, AuthError), f"the server authenticated the relayed client as {got!r}"
    if edit == "none":
        assert "a relay?" in str(got)                  # the server saw the hello naming A
    elif edit == "hello":
        assert "a relay?" in str(e.value)              # the client saw a proof for B
    else:
        assert "proof does not match" in str(e.value)  # the reply was altered


def test_the_server_proves_for_its_endpoint_and_identity():
    """An honest exchange works; a client that dialed another endpoint, or expects another
    identity, does not authenticate (and learns only "authentication failed" from the
    server)."""
    with honest_server("prefill-P") as (address, outcomes):
        with socket.create_connection(address, timeout=5) as s:
            client_authenticate(s, SECRET, endpoint=address, identity="kv_consumer:D",
                                expect_id="prefill-P")
        assert outcomes.get(timeout=5) == "kv_consumer:D"
        with socket.create_connection(address, timeout=5) as s, \
                pytest.raises(AuthError, match="expected 'prefill-Q'"):
            client_authenticate(s, SECRET, endpoint=address, expect_id="prefill-Q")
        assert isinstance(outcomes.get(timeout=5), AuthError)
        with socket.create_connection(address, timeout=5) as s:   # named by another name
            send_frame(s, {"auth": "hello", "v": auth.VERSION, "id": "x",
                           "nonce": base64.b64encode(b"n" * 32).decode(),
                           "endpoint": ["localhost", address[1]]})
            assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert "this listener is 127.0.0.1" in str(outcomes.get(timeout=5))


def test_a_server_proof_reflected_as_the_client_proof_fails():
    with honest_server() as (address, outcomes), \
            socket.create_connection(address, timeout=5) as s:
        send_frame(s, {"auth": "hello", "v": auth.VERSION, "id": "prefill-P",
                       "nonce": base64.b64encode(b"n" * 32).decode(), "endpoint": list(address)})
        reply = recv_frame(s)
        assert reply is not None and reply["ok"] is True and reply["endpoint"] == list(address)
        send_frame(s, {"auth": "proof", "proof": reply["proof"]})
        assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert isinstance(outcomes.get(timeout=5), AuthError)


@pytest.mark.parametrize("version", [1, 3, None, "2"])
def test_other_protocol_versions_are_refused(version):
    """A version-1 hello (the relayable protocol) gets "authentication failed" and the
    connection closes; the server's log names the version."""
    with honest_server() as (address, outcomes), \
            socket.create_connection(address, timeout=5) as s:
        send_frame(s, {"auth": "hello", "v": version,
                       "nonce": base64.b64encode(b"n" * 32).decode(),
                       "endpoint": list(address), "id": "x"})
        assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert s.recv(1) == b""
        got = outcomes.get(timeout=5)
    assert isinstance(got, AuthError)
    assert "protocol version" in str(got) and "speaks 2" in str(got)


def test_proofs_use_role_separated_keys_and_keep_the_secret_off_the_wire():
    keys = {role: auth._role_key(SECRET, role) for role in ("server", "client", "params")}
    assert len(set(keys.values())) == 3 and auth._key(SECRET) not in keys.values()
    t = auth._transcript(b"a" * 32, b"b" * 32, "c", ("h", 1), "s", ("h", 1))
    assert auth._proof(SECRET, "server", t) != auth._proof(SECRET, "client", t)


def test_the_side_channel_refuses_relayed_clients_and_serves_honest_ones(monkeypatch):
    """The real listener (FramedServer under the side channel): a client that dialed a
    relay gets nothing and the handler never runs; a direct one is served."""
    monkeypatch.setattr(auth, "AUTH_TIMEOUT_S", 5.0)
    calls: list[dict] = []

    def handler(msg: dict) -> dict:
        calls.append(msg)
        return {"metadata": "the prefill's KV addresses"}

    with SideChannelServer("127.0.0.1", 0, handler, secret=SECRET, identity="P") as srv:
        with relay(srv.address) as (attacker, accepted):
            with pytest.raises(SideChannelError, match=AUTH_FAILED):
                side_channel_call(*attacker, {"type": "handshake"}, secret=SECRET,
                                  expect_id="P")
            assert accepted[0] == 1
        assert calls == []
        assert side_channel_call(*srv.address, {"type": "x"}, secret=SECRET, expect_id="P")
        assert len(calls) == 1


def test_tcp_transport_refuses_a_reader_that_dialed_a_relay(monkeypatch):
    """A reader whose peer metadata points at a relay: no bytes, no read-done notice."""
    monkeypatch.setattr(auth, "AUTH_TIMEOUT_S", 5.0)
    data = torch.arange(64, dtype=torch.float32)
    server = TcpTransport("127.0.0.1", 0, secret=SECRET, identity="P-rank0")
    server.register([data])
    reader = TcpTransport("127.0.0.1", 0, secret=SECRET, serve=False, identity="D-rank0")
    reader.register([torch.zeros(64)])
    try:
        md = server.metadata()
        assert md["identity"] == "P-rank0" and (md["host"], md["port"]) == server.address
        with relay(server.address) as (attacker, accepted):
            reader.add_peer("p", dict(md, host=attacker[0], port=attacker[1]))
            h = reader.start_read("p", [ReadDesc(0, 0, 0, 256)], b"note")
            with pytest.raises(TransferError, match=AUTH_FAILED):
                reader.wait(h, timeout=10)
            assert accepted[0] >= 1
        assert not torch.equal(reader._flat[0].view(torch.float32), data)
        assert server.take_notifications() == []
        reader.add_peer("p", md)                       # the published endpoint works
        reader.wait(reader.start_read("p", [ReadDesc(0, 0, 0, 256)], b"note"), timeout=10)
        assert torch.equal(reader._flat[0].view(torch.float32), data)
        assert server.take_notifications() == [b"note"]
    finally:
        reader.close()
        server.close()


# -- the MAC on kv_transfer_params ------------------------------------------------------------


def tcp(role: str, **kw: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="TcpConnector", kv_role=role, backends=("TCP",),
                            lease_s=60, **kw)


@contextmanager
def connectors(monkeypatch, secret: bytes | None,
               **decode_config: Any) -> Iterator[tuple[KVConnector, KVConnector]]:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    if secret is None:
        monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    else:
        monkeypatch.setenv("KVRELAY_KV_SECRET", secret.decode())
    prefill = KVConnector(tcp("kv_producer", hold_share=1.0), "P", SPEC,
                          [torch.randn(2, NB, 2, 4, 8) for _ in range(2)])
    decode = KVConnector(tcp("kv_consumer", **decode_config), "D", SPEC,
                         [torch.zeros(2, NB, 2, 4, 8) for _ in range(2)])
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def signed(prefill: KVConnector, rid: str, blocks: list[int],
           prompt: list[int] = PROMPT) -> dict[str, Any]:
    """The kv_transfer_params the engine returns for a held request (as JSON)."""
    where = prefill.hold(rid, [blocks], prompt)
    return KVTransferParams(do_remote_prefill=True, remote_block_ids=[blocks],
                            **where).to_dict()


def parsed(raw: dict[str, Any]) -> KVTransferParams:
    p = KVTransferParams.from_dict(raw)
    assert p is not None
    return p


TAMPERED = {
    "remote_engine_id": "Q",
    "remote_host": "127.0.0.2",
    "remote_port": 1,
    "remote_request_id": "B",
    "tp_size": 2,
    "remote_capability": "A" * 43,
    "remote_block_ids": [[1, 2, 4]],
}


def test_the_prefill_signs_its_params_and_the_decode_verifies_every_field(monkeypatch):
    with connectors(monkeypatch, SECRET) as (prefill, decode):
        raw = signed(prefill, "A", [1, 2, 3])
        assert isinstance(raw["remote_mac"], str) and len(raw["remote_mac"]) == 43
        decode.verify_params(parsed(raw), PROMPT)
        for key, value in TAMPERED.items():
            with pytest.raises(KVParamsError, match="remote_mac does not match") as e:
                decode.verify_params(parsed(dict(raw, **{key: value})), PROMPT)
            assert e.value.param == "kv_transfer_params"
        # the same values with other JSON types, the MAC itself, another prompt, no MAC
        mac = raw["remote_mac"]
        flipped = mac[:-1] + ("B" if mac[-1] == "A" else "A")
        for key, value in (("tp_size", 1.0), ("remote_block_ids", [[1, 2, True]]),
                           ("remote_mac", flipped)):
            with pytest.raises(KVParamsError, match="remote_mac does not match"):
                decode.verify_params(parsed(dict(raw, **{key: value})), PROMPT)
        for prompt in (PROMPT[:-1], PROMPT + [1], [7] + PROMPT[1:]):
            with pytest.raises(KVParamsError, match="another prompt"):
                decode.verify_params(parsed(raw), prompt)
        no_mac = {k: v for k, v in raw.items() if k != "remote_mac"}
        with pytest.raises(KVParamsError, match="remote_mac is missing"):
            decode.verify_params(parsed(no_mac), PROMPT)
        # a mix of two signed params (one's capability with the other's block ids)
        other = signed(prefill, "B", [4, 5, 6])
        for key in ("remote_block_ids", "remote_capability", "remote_request_id"):
            with pytest.raises(KVParamsError):
                decode.verify_params(parsed(dict(raw, **{key: other[key]})), PROMPT)
        # a prefill with another secret signs params this decode refuses
        foreign = dict(raw, remote_mac=auth.params_mac(
            b"another topology", prompt_ids=PROMPT,
            **{k: raw[k] for k in ("remote_engine_id", "remote_host", "remote_port",
                                   "remote_request_id", "tp_size", "remote_capability",
                                   "remote_block_ids")}))
        with pytest.raises(KVParamsError):
            decode.verify_params(parsed(foreign), PROMPT)


def test_without_a_secret_the_params_are_as_before(monkeypatch):
    with connectors(monkeypatch, None) as (prefill, decode):
        raw = signed(prefill, "A", [1, 2, 3])
        assert "remote_mac" not in raw
        assert set(raw) == {"do_remote_decode", "do_remote_prefill", "remote_engine_id",
                            "remote_block_ids", "remote_host", "remote_port",
                            "remote_request_id", "tp_size", "remote_capability"}
        decode.verify_params(parsed(raw), PROMPT)                   # nothing to verify
        decode.verify_params(parsed(dict(raw, remote_port=1)), [1])


def test_allowed_prefills_is_enforced_with_or_without_a_secret(monkeypatch):
    cfg = KVTransferConfig.from_json({"kv_connector_extra_config": {
        "allowed_prefills": ["127.0.0.1:5600", " [::1]:5601", "prefill-0.example:7"]}})
    assert cfg is not None
    assert cfg.allowed_prefills == frozenset({("127.0.0.1", 5600), ("::1", 5601),
                                              ("prefill-0.example", 7)})
    for bad in ("127.0.0.1", ":5600", "h:0", "h:x", 5600, ["h:1", 2]):
        with pytest.raises(ValueError, match="allowed_prefills"):
            KVTransferConfig.from_json({"kv_connector_extra_config": {
                "allowed_prefills": bad if isinstance(bad, list) else [bad]}})
    for secret in (None, SECRET):
        with connectors(monkeypatch, secret) as (prefill, decode):
            assert prefill.advertised is not None
            decode.config = dataclasses.replace(
                decode.config, allowed_prefills=frozenset({prefill.advertised}))
            raw = signed(prefill, "A", [1, 2, 3])
            decode.verify_params(parsed(raw), PROMPT)
            decode.config = dataclasses.replace(
                decode.config, allowed_prefills=frozenset({("127.0.0.1", 1)}))
            with pytest.raises(KVParamsError, match="allowed_prefills"):
                decode.verify_params(parsed(raw), PROMPT)


def test_a_prefill_with_a_secret_never_advertises_a_wildcard(monkeypatch):
    """kvrelay proxy substitutes a wildcard remote_host; signed params cannot be changed,
    so such a prefill refuses to start instead of handing out unusable (or, unsigned,
    client-pickable) addresses."""
    monkeypatch.setenv("KVRELAY_SIDE_CHANNEL_ADVERTISE_HOST", "0.0.0.0")
    with pytest.raises(RuntimeError, match="KVRELAY_SIDE_CHANNEL_ADVERTISE_HOST"), \
            connectors(monkeypatch, SECRET):
        pass
    with connectors(monkeypatch, None) as (prefill, _):   # without a secret: as before
        assert prefill.advertised is not None and prefill.advertised[0] == "0.0.0.0"


# -- claims that are the client's mistake ---------------------------------------------------


def load(decode: KVConnector, raw: dict[str, Any], rid: str = "d") -> None:
    decode.start_load(rid, parsed(raw), [[5, 6, 7]], [KVCacheGroup(None, 2)], 0, 10, 4)


def test_refused_claims_are_claim_refused_and_broken_channels_are_not(monkeypatch):
    """Without a secret (no MAC to catch them first): another request's block ids and a
    replayed (already claimed) capability are ClaimRefused — the HTTP layer's 400 — while
    a prefill that is not there is a plain HandshakeError (502)."""
    with connectors(monkeypatch, None) as (prefill, decode):
        a, b = signed(prefill, "A", [1, 2, 3]), signed(prefill, "B", [4, 5, 6])
        with pytest.raises(ClaimRefused, match="not the blocks the prefill issued"):
            load(decode, dict(a, remote_block_ids=b["remote_block_ids"]))
        with pytest.raises(ClaimRefused, match="claimed already"):
            load(decode, a)                    # A was claimed by the attempt above
        load(decode, b, "d2")
        with pytest.raises(ClaimRefused):
            load(decode, b, "d3")              # a replay
        assert prefill.server is not None
        prefill.server.close()
        gone = signed(prefill, "C", [7, 8, 9])
        with pytest.raises(HandshakeError) as e:
            load(decode, gone, "d4")
        assert not isinstance(e.value, ClaimRefused)
