"""The KV plane's defences, in-process: the mutual challenge–response on the side channel
and the TCP transport, per-request capabilities (claim, release, read-done notices), the
hold share, and bounded listeners (small pre-auth frames, memory allocated as bytes
arrive, connection caps, idle timeouts). The real-process versions are in
tests/e2e/test_kv_security.py."""

from __future__ import annotations

import base64
import dataclasses
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvrelay.disagg import auth
from kvrelay.disagg.auth import AUTH_FAILED, client_authenticate
from kvrelay.disagg.connector import HandshakeError, HoldRefused, KVConnector
from kvrelay.disagg.params import KVTransferConfig, KVTransferParams
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
from kvrelay.kv_cache.spec import KVCacheSpec

SECRET = b"correct horse battery staple"
SPEC = KVCacheSpec("tiny:abc", "float32", 4, 2, 2, 8, hybrid=False, sliding_window=None)
NB = 10
PROMPT = list(range(100, 110))  # what the tests' prefill "computed" (10 tokens: blocks 0-2)


def echo(msg: dict) -> dict:
    return {"echo": msg.get("payload"), "spec": "secret-ish details"}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture()
def secured():
    srv = SideChannelServer("127.0.0.1", 0, echo, secret=SECRET, max_connections=16).start()
    try:
        yield srv
    finally:
        srv.close()


# -- the challenge–response --------------------------------------------------------------


def test_right_secret_works_many_calls(secured):
    assert side_channel_call(*secured.address, {"payload": 1}, secret=SECRET)["echo"] == 1


@pytest.mark.parametrize("secret", [None, b"wrong secret"])
def test_a_peer_without_the_secret_learns_only_authentication_failed(secured, secret):
    with pytest.raises(SideChannelError, match=AUTH_FAILED) as e:
        side_channel_call(*secured.address, {"payload": 1}, secret=secret)
    assert "secret-ish" not in str(e.value)
    # raw: a handshake sent without authenticating gets one reply, then the connection closes
    with socket.create_connection(secured.address, timeout=5) as s:
        send_frame(s, {"type": "handshake", "version": 2, "spec": {"block_size": 999}})
        assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert s.recv(1) == b""


def test_the_secret_never_crosses_the_wire_and_proofs_do_not_replay(secured):
    """Record what an honest client sends; replaying it on a new connection fails (fresh
    server nonce), and neither the secret nor its SHA-256 key appears in it."""
    sent: list[bytes] = []

    class Tap(socket.socket):
        def sendall(self, data, *a):  # type: ignore[override]
            sent.append(bytes(data))
            return super().sendall(data, *a)

    s = Tap(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(secured.address)
    client_authenticate(s, SECRET, endpoint=secured.address)
    s.close()
    wire = b"".join(sent)
    assert SECRET not in wire and auth._key(SECRET) not in wire
    assert base64.b64encode(auth._key(SECRET)) not in wire
    with socket.create_connection(secured.address, timeout=5) as r:
        for frame in sent:
            r.sendall(frame)
        replies = [recv_frame(r), recv_frame(r)]
    assert replies[1] == {"ok": False, "error": AUTH_FAILED}


def test_the_client_authenticates_the_server_too():
    """A server that does not know the secret (it answers with a made-up proof) is refused
    by the client before the client sends its own proof."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[dict | None] = []

    def fake() -> None:
        conn, _ = listener.accept()
        with conn:
            recv_frame(conn)
            send_frame(
                conn,
                {
                    "ok": True,
                    "nonce": base64.b64encode(b"n" * 32).decode(),
                    "endpoint": list(listener.getsockname()),
                    "id": "",
                    "proof": base64.b64encode(b"p" * 32).decode(),
                },
            )
            conn.settimeout(2)
            try:
                got.append(recv_frame(conn))
            except OSError:
                got.append(None)

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(SideChannelError, match="proof does not match"):
        side_channel_call(*listener.getsockname(), {"payload": 1}, secret=SECRET)
    t.join(5)
    listener.close()
    assert got == [None]  # the client's proof was never sent


def test_secret_from_env_wins_over_secret_file(tmp_path, monkeypatch):
    f = tmp_path / "kv.secret"
    f.write_text("from-file\n")
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    assert auth.load_secret({"secret_file": str(f)}) == b"from-file"
    assert auth.load_secret({}) is None
    monkeypatch.setenv("KVRELAY_KV_SECRET", "from-env")
    assert auth.load_secret({"secret_file": str(f)}) == b"from-env"
    monkeypatch.delenv("KVRELAY_KV_SECRET")
    with pytest.raises(ValueError, match="secret_file"):
        auth.load_secret({"secret_file": str(tmp_path / "missing")})


# -- bounded listeners -------------------------------------------------------------------


def test_idle_connection_flood_does_not_lock_out_honest_peers(secured):
    """More idle connections than the limit: the oldest unauthenticated ones are evicted,
    an honest peer still gets through."""
    flood = [socket.create_connection(secured.address, timeout=5) for _ in range(40)]
    try:
        time.sleep(0.2)
        assert side_channel_call(*secured.address, {"payload": 2}, secret=SECRET)["echo"] == 2
    finally:
        for s in flood:
            s.close()


def test_unauthenticated_connections_time_out(monkeypatch):
    monkeypatch.setattr(auth, "AUTH_TIMEOUT_S", 0.5)
    with (
        SideChannelServer("127.0.0.1", 0, echo, secret=SECRET) as srv,
        socket.create_connection(srv.address, timeout=5) as s,
    ):
        s.sendall(struct.pack(">I", 100) + b"{")  # a frame that trickles, then stops
        t0 = time.monotonic()
        assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3


def _announce_flood(address: tuple[str, int], n: int, size: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(address, timeout=5)
        s.sendall(struct.pack(">I", size) + b'{"')
        socks.append(s)
    return socks


@pytest.mark.parametrize("secret", [SECRET, None])
def test_side_channel_frames_announcing_megabytes_cost_nothing(secret):
    """200 connections announce frames just under the old 16 MiB limit and send 2 bytes:
    the server's memory stays flat and an honest call still works."""
    with SideChannelServer("127.0.0.1", 0, echo, secret=secret) as srv:
        before = rss_mib()
        flood = _announce_flood(srv.address, 200, 16 * 1024 * 1024 - 1)
        try:
            time.sleep(0.5)
            grown = rss_mib() - before
            assert side_channel_call(*srv.address, {"payload": 3}, secret=secret)["echo"] == 3
        finally:
            for s in flood:
                s.close()
    assert grown < 40, f"RSS grew {grown:.0f} MiB"


def test_tcp_transport_allocates_as_bytes_arrive_and_caps_threads():
    """Without a secret (post-auth frames may be 16 MiB): 150 connections announcing 16 MiB
    cost neither memory nor 150 threads; a read still works."""
    server = TcpTransport("127.0.0.1", 0)
    server.register([torch.arange(64, dtype=torch.float32)])
    reader = TcpTransport("127.0.0.1", 0)
    reader.register([torch.zeros(64)])
    threads, before = threading.active_count(), rss_mib()
    flood = _announce_flood(server.address, 150, 16 * 1024 * 1024 - 1)
    try:
        time.sleep(0.5)
        grown, extra_threads = rss_mib() - before, threading.active_count() - threads
        # without a secret the listener cannot tell a flood from readers: at the cap a new
        # connection is refused until one closes or idles out (IDLE_TIMEOUT_S)
        for s in flood[:8]:
            s.close()
        time.sleep(0.3)
        reader.add_peer("p", server.metadata())
        h = reader.start_read("p", [ReadDesc(0, 0, 0, 32)], b"n")
        reader.wait(h, timeout=20)
    finally:
        for s in flood:
            s.close()
        reader.close()
        server.close()
    assert grown < 40, f"RSS grew {grown:.0f} MiB"
    assert extra_threads <= 64 + 2, extra_threads


# -- the TCP transport's authentication ----------------------------------------------------


def test_tcp_transport_refuses_readers_without_the_secret():
    data = torch.arange(64, dtype=torch.float32)
    server = TcpTransport("127.0.0.1", 0, secret=SECRET)
    server.register([data])
    readers = {
        name: TcpTransport("127.0.0.1", 0, secret=s, serve=False)
        for name, s in [("right", SECRET), ("wrong", b"nope"), ("none", None)]
    }
    try:
        for name, r in readers.items():
            r.register([torch.zeros(64)])
            r.add_peer("p", server.metadata())
            h = r.start_read("p", [ReadDesc(0, 0, 0, 256)], b"note")
            if name == "right":
                r.wait(h)
                assert torch.equal(r._flat[0].view(torch.float32), data)
                continue
            with pytest.raises(TransferError) as e:
                r.wait(h)
            assert "authentication failed" in str(e.value) or "connection closed" in str(e.value)
            assert not torch.equal(r._flat[0].view(torch.float32), data)
        assert server.take_notifications() == [b"note"]
        # raw: a read request without authenticating is answered "authentication failed" only
        with socket.create_connection(server.address, timeout=5) as s:
            send_frame(s, {"op": "read", "descs": [[0, 0, 256]], "notify": "eA=="})
            assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        # a consumer's listener serves nobody's reads, authenticated or not
        consumer = readers["right"]
        with socket.create_connection(consumer.address, timeout=5) as s:
            client_authenticate(s, SECRET, endpoint=consumer.address)
            send_frame(s, {"op": "read", "descs": [[0, 0, 256]], "notify": "eA=="})
            assert recv_frame(s)["ok"] is False
    finally:
        for r in readers.values():
            r.close()
        server.close()


# -- capabilities -------------------------------------------------------------------------


def tcp(role: str, **kw) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="TcpConnector", kv_role=role, backends=("TCP",), lease_s=60, **kw
    )


@pytest.fixture()
def pair(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    monkeypatch.setenv("KVRELAY_KV_SECRET", SECRET.decode())
    prefill = KVConnector(
        tcp("kv_producer", hold_share=1.0),
        "P",
        SPEC,
        [torch.randn(2, NB, 2, 4, 8) for _ in range(2)],
    )
    decode = KVConnector(
        tcp("kv_consumer"), "D", SPEC, [torch.zeros(2, NB, 2, 4, 8) for _ in range(2)]
    )
    try:
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def issued(prefill: KVConnector, rid: str, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(remote_block_ids=[blocks], **prefill.hold(rid, [blocks], PROMPT))


def call(prefill: KVConnector, msg: dict) -> dict:
    return side_channel_call(*prefill.server.address, msg, secret=SECRET)


def load(decode: KVConnector, p: SimpleNamespace, rid: str = "d") -> None:
    decode.start_load(rid, p, [[5, 6, 7]], [KVCacheGroup(None, 2)], 0, 10, 4)


def wait_done(prefill: KVConnector, timeout: float = 10) -> list[str]:
    deadline, done = time.monotonic() + timeout, []
    while not done and time.monotonic() < deadline:
        done = prefill.read_done()
        time.sleep(0.01)
    return done


def test_the_prefill_issues_a_capability_and_decode_must_present_it(pair):
    prefill, decode = pair
    a, b = issued(prefill, "A", [1, 2, 3]), issued(prefill, "B", [4, 5, 6])
    assert len(a.remote_capability) >= 40 and a.remote_capability != b.remote_capability
    # a capability-less or forged params dict never reaches a read
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_block_ids": [[4, 5, 6]],
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_request_id": "B",
    }
    with pytest.raises(ValueError, match="remote_capability"):
        KVTransferParams.from_dict(params)
    forged = SimpleNamespace(**{**vars(b), "remote_capability": "guessed"})
    with pytest.raises(HandshakeError, match="unknown request or wrong capability"):
        load(decode, forged)
    # request A's capability with request B's block ids: refused before any read
    crossed = SimpleNamespace(**{**vars(a), "remote_block_ids": [[4, 5, 6]]})
    with pytest.raises(HandshakeError, match="not the blocks the prefill issued"):
        load(decode, crossed)
    assert decode.loads == {} and prefill.read_done() == []


def test_claims_do_not_replay_and_released_capabilities_are_dead(pair):
    prefill, decode = pair
    a = issued(prefill, "A", [1, 2, 3])
    load(decode, a, "d1")
    assert wait_done(prefill) == ["A"]
    # a second claim of the same grant (a replay while it is held) is refused
    b = issued(prefill, "B", [4, 5, 6])
    assert call(prefill, {"type": "claim", "request_id": "B", "capability": b.remote_capability})
    with pytest.raises(SideChannelError, match="unknown request or wrong capability"):
        call(prefill, {"type": "claim", "request_id": "B", "capability": b.remote_capability})
    # after the release, A's capability opens nothing
    prefill.released("A")
    for kind in ("claim", "release"):
        with pytest.raises(SideChannelError, match="unknown request or wrong capability"):
            call(prefill, {"type": kind, "request_id": "A", "capability": a.remote_capability})


def test_forged_release_and_notice_free_nothing(pair):
    prefill, _ = pair
    a = issued(prefill, "A", [1, 2, 3])
    for bad in ({}, {"capability": "x"}, {"capability": a.remote_capability + "x"}):
        with pytest.raises(SideChannelError, match=r"^.*unknown request or wrong capability$"):
            call(prefill, {"type": "release", "request_id": "A", **bad})
    prefill.transport._notifs += [
        b"A:1",
        b"A:1:forged",
        b"A",
        b"A:1:" + a.remote_capability.encode()[:-1],
    ]
    assert prefill.read_done() == [] and "A" in prefill.held.grants
    call(prefill, {"type": "release", "request_id": "A", "capability": a.remote_capability})
    assert prefill.read_done() == ["A"]


def test_an_explicit_free_needs_the_capability(pair):
    """What POST /v1/kv_transfer/free asks the connector (engine/core.free_remote)."""
    prefill, _ = pair
    a = issued(prefill, "A", [1, 2, 3])
    for bad in (None, "", "x", a.remote_capability[:-1], a.remote_capability + "x"):
        assert not prefill.holds("A", bad)
    assert not prefill.holds("B", a.remote_capability)
    assert prefill.holds("A", a.remote_capability)
    prefill.released("A")
    assert not prefill.holds("A", a.remote_capability)


def test_ucx_listens_where_the_side_channel_host_says_on_both_sides():
    from kvrelay.disagg.worker import ucx_host
    assert ucx_host(True, None) == "127.0.0.1"        # a producer's side channel default
    assert ucx_host(True, "127.0.0.2") == "127.0.0.2"
    assert ucx_host(False, "127.0.0.1") == "127.0.0.1"  # a consumer, when the host is set
    assert ucx_host(False, None) is None              # unset: not a statement about prefills
    assert ucx_host(False, "0.0.0.0") not in (None, "0.0.0.0")  # the advertised address


def test_holds_are_bounded_by_the_hold_share(pair):
    prefill, _ = pair
    prefill.config = dataclasses.replace(prefill.config, hold_share=0.5)
    limit = int(0.5 * prefill.num_blocks)  # 5 of 10
    issued(prefill, "A", [1, 2, 3])
    with pytest.raises(HoldRefused, match="hold_share"):
        issued(prefill, "B", [4, 5, 6])
    assert "B" not in prefill.held.grants and len(prefill.held.blocks) == 3 <= limit
    issued(prefill, "C", [2, 3, 4])  # shared prefix blocks count once
    assert len(prefill.held.blocks) == 4
    prefill.released("A")
    prefill.released("C")
    assert len(prefill.held.blocks) == 0
    issued(prefill, "B", [4, 5, 6])


def test_hold_share_is_validated():
    with pytest.raises(ValueError, match="hold_share"):
        KVTransferConfig.from_json({"kv_connector_extra_config": {"hold_share": 0}})
    assert (
        KVTransferConfig.from_json({"kv_connector_extra_config": {"hold_share": 0.25}}).hold_share
        == 0.25
    )
    assert KVTransferConfig.from_json({}).hold_share == 0.5


def test_a_failed_authentication_is_a_connection_error(secured):
    # the transports' OSError handling (drop the connection, report it) covers it
    with (socket.create_connection(secured.address, timeout=5) as s,
          pytest.raises(ConnectionError, match=AUTH_FAILED)):
        client_authenticate(s, b"wrong secret", endpoint=secured.address)


@pytest.mark.parametrize(
    "host,secret,warned", [("0.0.0.0", None, 1), ("0.0.0.0", "s", 0), ("127.0.0.1", None, 0)]
)
def test_one_warning_when_the_kv_plane_is_exposed_without_a_secret(
    monkeypatch, caplog, host, secret, warned
):
    monkeypatch.setattr(auth, "_warned", set())
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", host)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    if secret:
        monkeypatch.setenv("KVRELAY_KV_SECRET", secret)
    else:
        monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    with caplog.at_level("WARNING"):
        c = KVConnector(
            tcp("kv_producer"), "P", SPEC, [torch.zeros(2, NB, 2, 4, 8) for _ in range(2)]
        )
        c.close()
    found = [r for r in caplog.records if "KVRELAY_KV_SECRET" in r.getMessage()]
    assert len(found) == warned
    if warned:
        assert host in found[0].getMessage() and "without authentication" in found[0].getMessage()


def test_tcp_reads_are_checked_against_the_issued_blocks(pair, monkeypatch):
    """Even an authenticated peer reads over TCP only the blocks issued for the request its
    notice names, with that request's capability, while the request is held."""
    from kvrelay.disagg import worker

    monkeypatch.setattr(worker, "GRANT_WAIT_S", 0.2)
    prefill, _ = pair
    a = issued(prefill, "A", [1, 2, 3])
    issued(prefill, "B", [6, 7])
    block = 2 * 4 * 8 * 4  # bytes of one block of one layer's K

    def read(notify: str, block_id: int, v: bool = False) -> dict:
        offset = ((NB if v else 0) + block_id) * block
        with socket.create_connection(prefill.transport.address, timeout=5) as s:
            client_authenticate(s, SECRET, endpoint=prefill.transport.address)
            send_frame(
                s,
                {
                    "op": "read",
                    "descs": [[1, offset, block]],
                    "notify": base64.b64encode(notify.encode()).decode(),
                },
            )
            return recv_frame(s)

    cap = a.remote_capability
    assert read(f"A:1:{cap}", 2) == {"ok": True, "nbytes": block}
    assert read(f"A:1:{cap}", 3, v=True)["ok"] is True
    for note, block_id in (
        (f"A:1:{cap}", 6),
        (f"A:1:{cap}x", 2),
        ("A:1:", 2),
        ("A", 2),
        (f"B:1:{cap}", 6),
    ):
        reply = read(note, block_id)
        assert reply["ok"] is False, (note, block_id)
    with socket.create_connection(
        prefill.transport.address, timeout=5
    ) as s:  # straddles blocks 3|4
        client_authenticate(s, SECRET, endpoint=prefill.transport.address)
        send_frame(
            s,
            {
                "op": "read",
                "descs": [[0, 3 * block + 8, block]],
                "notify": base64.b64encode(f"A:1:{cap}".encode()).decode(),
            },
        )
        assert "beyond the blocks" in recv_frame(s)["error"]
    prefill.released("A")
    assert read(f"A:1:{cap}", 2) == {"ok": False, "error": "unknown request or wrong capability"}
